"""Training: the config, the built-in workloads, and the loop each rank runs."""

from ddpkit.train.config import TrainConfig
from ddpkit.train.trainer import Trainer
from ddpkit.train.workloads import WORKLOADS, Job, Workload

__all__ = ["WORKLOADS", "Job", "TrainConfig", "Trainer", "Workload"]
