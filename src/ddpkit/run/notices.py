"""What rank 0 says once when a loop does something that one device would do differently.

Each is a warning, not an error: the loop may mean it. The step cycle decides when, and that it
is said once per run.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def own_counter(step: int, resumed_at: int) -> None:
    """A resumed run left the loader before the epoch's end: its own step counter started at 0."""
    log.warning(
        "the loop left run.loader's loop at step %d, before the epoch's end, in a run resumed at "
        "step %d: a loop that counts its own steps (if i == budget: break) counted from 0 again; "
        "use ddpkit.Run(steps=N), compare with run.step, or track the counter (run.track(loop=state))",
        step,
        resumed_at,
    )


def stale_weights(step: int) -> None:
    """A backward after a deferred optimizer step in the same micro-batch (a GAN's generator pass)."""
    log.warning(
        "step %d: run.backward after optimizer.step() in the same micro-batch: under micro_batch "
        "that step waits for the step's last micro-batch, so this loss saw the weights before it, "
        "where one device would use the stepped ones (a GAN's generator pass through the "
        "discriminator it just stepped); train the models on alternate steps (examples/gan.py) "
        "or leave micro_batch unset",
        step,
    )
