"""The bucket layout trial: its schedule and decision, and a 2-rank run through it against torch's DDP."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit import DataParallel
from ddpkit.parallel.layout import TRIAL_PASSES, Layout, LayoutTrial, trial_for

pytestmark = pytest.mark.slow  # each file spawns its ranks once, for a few seconds


def _trial(margin: float = 0.03) -> LayoutTrial:
    return LayoutTrial((Layout("one", 100, 100), Layout("split", 10, 10)), rounds=2, margin=margin)


def _run(trial: LayoutTrial, one_s: float, split_s: float, one_wait: float = 0.5) -> list[int]:
    """Drive the trial as the reducer does: a pass, then maybe a rebuild; the layouts it built.
    One bucket waits ``one_wait`` of its ``one_s`` after backward, the split layout 0.1 s."""
    built = []
    for _ in range(12):
        trial.pass_done(*((one_s, one_wait) if trial.current == 0 else (split_s, 0.1)))
        if trial.due():
            slowest = trial.fastest() if trial.deciding else None
            trial.adopt(trial.propose(slowest), rank=0)
            built.append(trial.current)
    return built


def test_trial_alternates_then_keeps_the_faster_once() -> None:
    trial = _trial()
    assert _run(trial, one_s=1.0, split_s=0.7) == [1, 0, 1, 0, 1]  # two rounds each, then split
    assert trial.chosen == 1 and trial.seconds == [[1.0, 1.0], [0.7, 0.7]]  # pass 1 not timed
    assert "split (9.54e-06 MiB buckets) 700 ms (kept)" in trial.describe()
    assert trial.describe().endswith("one waited 500 ms after backward")


def test_trial_keeps_the_first_layout_unless_another_beats_it_by_the_margin() -> None:
    assert _run(_trial(), one_s=1.0, split_s=0.98)[-1] == 0  # 2% faster: within the noise margin
    assert _run(_trial(margin=0.0), one_s=1.0, split_s=0.98)[-1] == 1
    # 0.3 s faster, but one bucket left only 0.1 s unhidden: that gain is the machine's load
    assert _run(_trial(), one_s=1.0, split_s=0.7, one_wait=0.1)[-1] == 0
    shadowed = _trial()
    for _ in range(6):  # a joined rank counts its shadow passes, so its rebuilds line up
        shadowed.pass_done(None)
    assert shadowed.passes == 6 and shadowed.seconds == shadowed.waits == [[], []]


def test_small_models_and_small_caps_have_no_trial() -> None:
    assert trial_for(list(nn.Linear(64, 64).parameters()), 25 * 2**20) is None
    big = list(nn.Linear(1024, 4096).parameters())  # 16 MiB and a bias: buckets of a sixteenth
    assert trial_for(big, 2**20) is None  # a 1 MiB cap: one bucket is already the split layout
    trial = trial_for(big, 25 * 2**20)
    assert trial is not None and [c.cap_bytes for c in trial.candidates] == [25 * 2**20, 2**20 + 1024]
    assert "split (0.25 MiB first, 1 MiB buckets) not measured" in trial.describe()


class Deep(nn.Module):
    """Eight 1 MiB layers: large enough for the trial to split its gradients into buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _through_the_trial(env) -> tuple[bool, list[str], str]:
    torch.manual_seed(0)
    base = Deep()
    native, reference = DataParallel(copy.deepcopy(base)), DistributedDataParallel(copy.deepcopy(base))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("ddpkit.parallel").addHandler(handler)
    logging.getLogger("ddpkit.parallel").setLevel(logging.INFO)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (native, reference)]
    gen = torch.Generator().manual_seed(env.rank)
    counts = set()
    for _ in range(TRIAL_PASSES + 2):
        x, y = torch.randn(4, 512, generator=gen), torch.randn(4, 512, generator=gen)
        for model, opt in zip((native, reference), opts, strict=True):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        counts.add(len(native.reducer.buckets))
    same = all(torch.equal(a, b) for a, b in zip(native.parameters(), reference.parameters(), strict=True))
    layout = native.reducer.layout.name
    return same and counts == {1, 8}, records, layout


def test_two_ranks_through_the_trial_equal_torch_ddp_bit_for_bit() -> None:
    (same0, logged0, layout0), (same1, logged1, layout1) = run_ranks(_through_the_trial, 2)
    assert same0 and same1, "both layouts were built, and the weights equal torch DDP's"
    assert layout0 == layout1  # every rank builds the layout rank 0 chose
    assert len(logged0) == 1 and logged0[0].startswith("DataParallel chose the bucket layout: ")
    # It names the layout it kept. Which one that is depends on the timing (the trial measures both),
    # and a kept split layout's own parentheses hold a comma ("0.25 MiB first, 1 MiB buckets").
    kept = re.search(r"(?:: |, )(\S+) \([^()]*\) [^,;()]*\(kept\)", logged0[0])
    assert kept and kept.group(1) == layout0, logged0[0]
    assert logged1 == []  # logged once, on rank 0
