"""Graceful preemption: a signal (SLURM, Kubernetes, a spot instance, Ctrl-C) ends the run at a step
boundary that every rank agrees on, with a checkpoint of that step.

The handler only records the signal. Ranks receive it at slightly different moments, so they
agree with one all-reduce (MAX of the signal number) every ``every`` steps: about half a second
of steps by the measured step time, and at least at every log step. The agreement costs one tiny
collective per half second or per log line, and a stop waits at most that long plus a step. A
second signal exits at once; the checkpoint being written is then abandoned and the previous good
one stays.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

AGREE_S = 0.5  # how often, in seconds of training, the ranks agree on whether to stop


class Preemption:
    """Signal handlers for one run, and the agreement the step cycle asks for.

    Args:
        names: comma-separated signal names without ``SIG`` (``"TERM,INT"``); empty: none.
        device: where the agreement's tensor lives (the backend's device).
    """

    def __init__(self, names: str, device: torch.device) -> None:
        self.device, self.received, self.every = device, 0, 1
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # Python lets only the main thread install handlers
        for name in filter(None, (n.strip() for n in names.split(","))):
            number = getattr(signal, f"SIG{name}")
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number: int, frame: object) -> None:
        if self.received:  # the second signal: no more waiting
            os._exit(128 + number)
        self.received = number

    def pace(self, seconds_per_step: float, at_most: int) -> None:
        """Agree about every AGREE_S seconds, and at least every ``at_most`` steps (the log steps');
        ``seconds_per_step`` must be the same on every rank."""
        steps = int(AGREE_S / seconds_per_step) if seconds_per_step > 0 else 1
        self.every = max(1, min(steps, at_most))

    def agreed(self, step: int) -> int:
        """The signal every rank now acts on (0: none). Collective on the steps that agree."""
        if step % self.every:
            return 0
        flag = torch.tensor([self.received], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        """Put back the handlers that were there before the run."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


def exit_preempted(number: int, step: int, saved: bool, is_rank0: bool) -> None:
    """End the process after an agreed preemption: one line from rank 0, exit code 128 + signal."""
    if is_rank0:
        where = "checkpoint written" if saved else "no out, so no checkpoint"
        print(
            f"ddpkit: preempted by {signal.Signals(number).name} at step {step} ({where}); "
            "resume with --resume auto (a script's ddpkit.Run: resume='auto', its default)",
            flush=True,
        )
    raise SystemExit(128 + number)
