"""The built-in Trainer and ``ddpkit train``: a client of ddpkit.Run for tasks given as a file or a name."""

from ddpkit.train.config import TrainConfig
from ddpkit.train.job import JobConfig
from ddpkit.train.task import Task
from ddpkit.train.trainer import Trainer
from ddpkit.train.workloads import WORKLOADS, Workload

__all__ = ["WORKLOADS", "JobConfig", "Task", "TrainConfig", "Trainer", "Workload"]
