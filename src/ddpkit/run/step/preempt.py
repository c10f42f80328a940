"""Graceful preemption: a signal (SLURM, Kubernetes, a spot instance, Ctrl-C) ends the run at a step
boundary that every rank agrees on, with a checkpoint of that step.

The handler only records the signal. Ranks receive it at slightly different moments, so they
agree with one all-reduce (MAX of the signal number) every ``every`` steps: about half a second
of steps by the measured step time, and at least at every log step. The agreement costs one tiny
collective per half second or per log line, and a stop waits at most that long plus a step. On a
GPU the agreement must not make the CPU wait for the device (reading its result would): its
result is copied to pinned memory without blocking and read at the next agreeing step, where it
has long landed, so every rank acts on the same result at the same step, one agreement later. A
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
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None  # a GPU's last agreement
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
        if self.device.type != "cuda":
            flag = torch.tensor([self.received], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return int(flag.item())
        if self._pending is not None:  # the last agreement's result, read now: no wait for the GPU
            host, landed = self._pending
            self._pending = None
            landed.synchronize()  # long done but on the rare step the GPU runs far behind
            if int(host):
                return int(host)
        flag = torch.full((1,), self.received, dtype=torch.int32, device=self.device)  # no host copy
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self._pending = (host, landed)
        return 0

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
