"""How a Run ends: finished after its last step, closed after an error, preempted, or at exit.

``Run`` inherits these; they use its models, monitor, step cycle, lock and process group, and
no other part of it.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys

from ddpkit.dist import destroy
from ddpkit.run.engine import unwrap
from ddpkit.run.setup import save_weights

log = logging.getLogger(__name__)


class RunEnd:
    """The end of a ``ddpkit.Run``: ``finish``, ``close``, the context manager, and exits."""

    def finish(self) -> None:
        """Finish the last step (its log line and checkpoint), write OUT/NAME.pt for every model on
        rank 0, draw OUT/loss.png, and leave the process group. All ranks call it. A run whose loop
        ended normally is finished at exit if the script does not call this itself."""
        if self._finished:
            return
        if self.monitor.bar is not None:  # the loop ran: close its last step as the run's last
            self.cycle.finish(last=True)
        self._restore()  # a resumed run that had nothing left to do still checks what it resumed
        if self.env.is_rank0 and self.out is not None:
            for name, model in self.models.items():
                save_weights(unwrap(model), self.out / f"{name}.pt")
        self.close(plot=True)

    def close(self, plot: bool = False) -> None:
        """Stop the diagnostics and leave the process group without another collective (after an error)."""
        self._finished = True
        atexit.unregister(self._finish_at_exit)
        if hasattr(self, "_preemption"):
            self._preemption.restore()
        self.monitor.close(plot)
        self._leave()

    def _preempted(self, number: int, step: int) -> None:
        """Every rank, after the preemption checkpoint: leave cleanly and exit without a traceback."""
        self.close()
        if self.env.is_rank0:
            where = "checkpoint written" if self.out is not None else "no out, so no checkpoint"
            print(
                f"ddpkit: preempted by {signal.Signals(number).name} at step {step} ({where}); "
                "resume with --resume auto (a script's ddpkit.Run: resume='auto', its default)",
                flush=True,
            )
        raise SystemExit(128 + number)

    def _leave(self) -> None:
        if self._lock is not None:
            self._lock.release()
        if self._owns_group:
            destroy()

    def _finish_at_exit(self) -> None:
        # Only after a loop that ended normally: a rank leaving through an exception must not
        # enter a collective its peers never reach (sys.last_value is set by the excepthook).
        if self._finished or getattr(sys, "last_value", None) is not None or self.monitor.bar is None:
            return self.close()
        log.info("finishing the run at exit (run.finish() was not called)")
        self.finish()

    def __enter__(self):
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        if kind is None:
            self.finish()
        else:
            self.close()
