"""``ddpkit check``: whether the user's own script takes the same steps on any number of processes.

The script runs a few steps on each process count under ``ddpkit run`` (command.py), each rank
with ``ddpkit.Run``'s options overridden for the check: a scratch out, ``steps=K``, a metrics line
a step, nothing resumed (worker.py records the weights after every optimizer step). Its losses
and weights are held against one process's, and against the noise floor: the same process count
of one with its sums cut otherwise (another CPU thread count). What rank 0 said about the habits
that break the same update (run/step/first_step.py) names the cause.
"""
