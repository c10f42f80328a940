"""Driving one step: the step cycle that owns where the run is (``StepCycle`` in cycle.py, its
boundaries in boundary.py) and the parts it calls at each point of a step: what ``run.backward``
scales a loss by (losses.py), the gradients held aside between micro-batches (held_grads.py), the
optimizer gate that lets optimizers, schedulers and averages act once per global batch (optim.py)
and its non-finite check (norms.py), the replica check (replicas.py), the preemption agreement
(preempt.py) and rank 0's lines after the first micro-batch (first_step.py). The step's state and
a micro-batch's description are leaves of run/ (step_state.py, micro.py), read by every folder.
"""
