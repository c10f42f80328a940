"""One rank of a ``ddpkit check`` run: the user's script, with ``ddpkit.Run`` set up for the check.

Started by ``ddpkit run`` as ``worker.py --record FILE --out DIR --steps K [--suspect NAME]
[--cut N] SCRIPT ARGS``. Every
``ddpkit.Run`` the script makes gets ``out=DIR`` (a scratch folder: nothing of the user's is read
or written), ``steps=K``, a metrics line a step, no checkpoint and no resume; the models it sets up
are watched, and after each optimizer step their weights are taken (as float32, on the CPU). Rank
0 writes them to FILE when the script ends: ``{step: {name: tensor}}``, step 0 being the weights
``run.setup`` returned. ``--suspect NAME`` switches one habit off in every process (suspects.py).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import ddpkit
from ddpkit.check.suspects import NAMES, CentredDraws, freeze_batch_norms, seed_globals_by_step
from ddpkit.errors import ConfigError
from ddpkit.run.data.loader import Loader


class Recorder:
    """The watched models' weights after every optimizer step of the run."""

    def __init__(self) -> None:
        self.run: ddpkit.Run | None = None
        self.models: list[tuple[str, nn.Module]] = []
        self.steps: dict[int, dict[str, torch.Tensor]] = {}

    def take(self, step: int) -> None:
        """The weights now, as those after ``step`` (a later optimizer of the same step replaces them)."""
        weights = {}
        for name, model in self.models:
            for key, p in ddpkit.unwrap(model).named_parameters():
                value = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
                weights[f"{name}.{key}"] = value.float().cpu().clone()
        self.steps[step] = weights

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.run is not None and self.models:
            self.take(self.run.step)


def patch(recorder: Recorder, out: str, steps: int, suspect: str | None, cut: int | None = None) -> None:
    """Every ``ddpkit.Run`` made from here on is the check's; its set-up models are watched,
    ``suspect`` (suspects.py) is switched off, and with ``cut`` the batch is cut into the
    micro-batches ``cut`` processes would cut it into (the floor on a GPU)."""
    make, setup = ddpkit.Run.__init__, ddpkit.Run.setup

    def checked_init(run: ddpkit.Run, *given: object, **options: object) -> None:
        options.pop("out", None)  # the script's folder stays untouched: the check writes its own
        options.update(steps=steps, save_every=0, log_every=1, progress=False, resume="never")
        if suspect == "dropout":
            options["invariant_dropout"] = True
        if cut is not None:
            options["micro_batch"] = cut_micro_batch(options, cut)
        make(run, out, **options)
        recorder.run = run

    def watched_setup(run: ddpkit.Run, model: nn.Module, *args: object, **kwargs: object) -> nn.Module:
        if suspect == "batchnorm":
            freeze_batch_norms(model)
        wrapped = setup(run, model, *args, **kwargs)
        recorder.models.append((str(kwargs.get("name", "model")), wrapped))
        if run.step == 0:  # the weights every count starts from
            recorder.take(0)
        return wrapped

    ddpkit.Run.__init__ = checked_init
    ddpkit.Run.setup = watched_setup
    register_optimizer_step_post_hook(recorder.after_optimizer_step)
    if suspect == "loss":
        backward = ddpkit.Run.backward

        def as_sum(
            run: ddpkit.Run, loss: torch.Tensor, reduction: str = "mean", count: object = None
        ) -> None:
            backward(run, loss, "sum" if reduction == "mean" and count is None else reduction, count)

        ddpkit.Run.backward = as_sum
    if suspect == "draws":
        drive = Loader.__iter__

        def centred(loader: Loader) -> Iterator[Any]:
            for batch in drive(loader):
                seed_globals_by_step(
                    recorder.run.seed if recorder.run else 0, recorder.run.step if recorder.run else 0
                )
                with CentredDraws():  # the loop body's draws, until it asks for the next batch
                    yield batch

        Loader.__iter__ = centred


def cut_micro_batch(options: dict, cut: int) -> int:
    """The micro-batch ``cut`` processes run for the Run ``options`` describe: their share of the
    global batch, or the script's micro_batch when that is smaller."""
    global_batch, micro = options.get("global_batch"), options.get("micro_batch")
    if not isinstance(global_batch, int):
        raise ConfigError(
            "ddpkit check --floor micro: the script's ddpkit.Run sets no global_batch=, and the floor "
            "cuts that batch as the processes would; give it one, or use --floor threads on a CPU"
        )
    share = global_batch // cut
    return min(micro, share) if micro else share


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--suspect", choices=NAMES, default=None)
    parser.add_argument("--cut", type=int, default=None)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    recorder = Recorder()
    patch(recorder, ns.out, ns.steps, ns.suspect, ns.cut)
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, str(Path(ns.script).resolve().parent))
    try:
        runpy.run_path(ns.script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    if recorder.run is not None and recorder.run.is_main:
        torch.save(recorder.steps, ns.record)


if __name__ == "__main__":
    main(sys.argv[1:])
