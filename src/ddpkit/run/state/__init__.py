"""A run's saved state: what a checkpoint holds, each registered part's ``state_dict()``, and how
it is saved and restored (checkpoints.py); the DCP state of a sharded model and its optimizers
(dcp_state.py); which checkpoint a run continues from (resume.py); the process group and the
output folder's lock a run holds (session.py); the names of what the user registers
(registry.py); the best checkpoint kept by a metric (best.py); and the weights' averages saved
with the run, ddpkit's own EMA (ema.py) and other libraries' (averages.py).
"""
