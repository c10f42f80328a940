"""Where one rank's run is: the step state, written by the step cycle alone and read by the rest.

``StepCycle`` (run/step/cycle.py) owns one ``StepState`` and is the only code that assigns its
fields (tests/test_state_owners.py checks that). The gated optimizers,
schedulers and EMAs (run/step/optim.py, run/state/ema.py) and the engine wrapper
(run/engine/wrap.py, run/engine/local.py) are handed the same object when they are made and read
it when they act: no flag is pushed into them per step, and nothing is set on the user's model.
It is a leaf of run/, beside config.py, because the engine and state folders read it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepState:
    """One rank's position in the run, as the step cycle last set it.

    Attributes:
        step: optimizer steps begun: the open step's number, or the last one's between steps.
        epoch: the epoch of the last step begun (a pass of the loader; 0 before the first).
        open: inside a step, from its first micro-batch's fetch to the close after its last.
        micro_batches: micro-batches entered in the open step.
        accumulating: the micro-batch in hand is not its step's last: optimizer and scheduler
            steps wait, and the engines do not synchronize its gradients.
        has_backward: a backward ran in the open step, so ``zero_grad()`` keeps its gradients.
    """

    step: int = 0
    epoch: int = 0
    open: bool = False
    micro_batches: int = 0
    accumulating: bool = False
    has_backward: bool = False
