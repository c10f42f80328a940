"""``ddpkit check``: whether the user's own script takes the same steps on any number of processes.

The script runs a few steps on each process count under ``ddpkit run`` (command.py), each rank
with ``ddpkit.Run``'s options overridden for the check: a scratch out, ``steps=K``, a metrics line
a step, nothing resumed (worker.py records the weights after every optimizer step). Its losses
and weights are held against one process's, and against the noise floor: the same process count
of one with its sums cut otherwise (another CPU thread count). When a count is not the same run,
the first steps run again with each suspect habit switched off (suspects.py), and those that close
the gap are named with their fix (trials.py; ``ddpkit.check.compare`` is the library call).
"""

from ddpkit.check.trials import Limits, Report, RunFailed, compare

__all__ = ["Limits", "Report", "RunFailed", "compare"]
