"""Recipes of docs/porting.md for scripts ported from Accelerate and timm: ``run.print``,
``run.main_first`` (Accelerate's ``main_process_first``) and a Mixup over ``run.all_gather`` (timm's
Mixup on the global batch). One launch of 2 processes runs both multi-process checks; the
references are a world of one in this process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.launch.start_method import FORKSERVER

N, GLOBAL_BATCH, CLASSES = 17, 8, 3  # steps of 8, 8 and 1 sample: rank 1 runs a stand-in in the last


def test_print_takes_its_own_flush_and_other_keywords(capsys):
    run = ddpkit.Run(progress=False)
    try:
        run.print("a", 1, sep="-", flush=True)
        run.print("b", end="", flush=False)
        run.print()
    finally:
        run.close()
    assert capsys.readouterr().out == "a-1\nb\n"


def test_main_first_in_a_world_of_one_just_runs_the_block():
    run = ddpkit.Run(progress=False)
    try:
        ran = []
        for local in (False, True):
            with run.main_first(local=local):
                ran.append(local)
    finally:
        run.close()
    assert ran == [False, True]


def _first(root: str, local: bool) -> bool:
    """One rank's part in a block whose first runner writes a cache slowly: whether it made it."""
    run = ddpkit.Run(progress=False)
    cache, order = Path(root) / f"cache-{local}", Path(root) / f"order-{local}.txt"
    try:
        with run.main_first(local=local):
            made = not cache.exists()
            if made:
                time.sleep(0.5)  # a slow datasets.map: the others must wait for its cache
                cache.write_text("mapped")
            with order.open("a") as file:
                file.write(f"{run.rank}\n")
    finally:
        run.close()
    return made


def mixup(x: torch.Tensor, y: torch.Tensor, alpha: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's Mixup in its 'batch' mode: one lam for the batch from np.random, each sample paired
    with the batch flipped, the one-hot labels mixed alike."""
    lam = float(np.random.beta(alpha, alpha))
    target = F.one_hot(y, CLASSES).float()  # (B, CLASSES)
    return x * lam + x.flip(0) * (1 - lam), target * lam + target.flip(0) * (1 - lam)


def _mixup_run(out: str, gathered: bool) -> dict:
    """Two epochs of a classifier on mixed batches: the global batch's (porting.md's recipe) or,
    ``gathered=False``, each rank's own share. The metrics lines' losses and the final weights."""
    run = ddpkit.Run(out=out, global_batch=GLOBAL_BATCH, shuffle=False, log_every=1, progress=False, seed=3)
    torch.manual_seed(0)
    model = run.setup(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, CLASSES)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    run.track(optimizer)
    g = torch.Generator().manual_seed(7)
    loader = run.loader(
        TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, CLASSES, (N,), generator=g))
    )
    for _ in range(loader.epoch, 2):
        for x, y in loader:
            if gathered:
                xs, ys = mixup(run.all_gather(x), run.all_gather(y))  # the global batch, one lam
                rows = slice(run.batch_offset, run.batch_offset + len(x))  # this rank's samples
                x, soft = xs[rows], ys[rows]
            else:
                x, soft = mixup(x, y)
            loss = torch.sum(-soft * F.log_softmax(model(x), dim=-1), dim=-1).mean()  # SoftTargetCrossEntropy
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
    weights = {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
    run.finish()
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines() if run.is_main else []
    return {"losses": [json.loads(line)["loss"] for line in lines if '"loss"' in line], "weights": weights}


def _world(root: str) -> dict:
    """Every check's part on one rank of the launched world."""
    return {
        "made": [_first(root, local) for local in (False, True)],
        "gathered": _mixup_run(f"{root}/gathered", gathered=True),
        "own": _mixup_run(f"{root}/own", gathered=False),
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("two")
    return root, ddpkit.launch(_world, 2, (str(root),), start_method=FORKSERVER)


@pytest.mark.slow
def test_main_first_runs_rank_0s_block_before_the_others_which_find_its_cache(two):
    root, ranks = two
    assert [rank["made"] for rank in ranks] == [[True, True], [False, False]]
    for local in (False, True):  # one machine: its local rank 0 is rank 0
        assert (root / f"order-{local}.txt").read_text() == "0\n1\n"


@pytest.mark.slow
def test_mixup_of_the_gathered_batch_gives_one_processs_losses_and_weights(two, tmp_path):
    _, ranks = two
    alone = _mixup_run(str(tmp_path / "alone"), gathered=True)
    both = ranks[0]["gathered"]
    assert len(alone["losses"]) == len(both["losses"]) == 6
    np.testing.assert_allclose(both["losses"], alone["losses"], rtol=0, atol=1e-6)
    for key, value in alone["weights"].items():
        torch.testing.assert_close(both["weights"][key], value, rtol=0, atol=1e-6)
        assert torch.equal(ranks[1]["gathered"]["weights"][key], both["weights"][key])
    # Each rank mixing its own share pairs other samples: not one process's losses.
    assert max(abs(a - b) for a, b in zip(ranks[0]["own"]["losses"], alone["losses"], strict=True)) > 1e-3


def _main_first_on_rank_0_only(out: str) -> None:
    """The mistake: ``main_first`` under ``if run.is_main:``, the other rank gone on to evaluate."""
    run = ddpkit.Run(out=out, progress=False, collective_timeout=60, desync_timeout=2)
    model = run.setup(nn.Linear(2, 1))
    data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    if run.is_main:
        with run.main_first():
            pass
    run.evaluate(data, lambda batch: F.mse_loss(model(batch[0]), batch[1]))
    run.finish()


@pytest.mark.slow
def test_main_first_on_one_rank_only_is_reported_with_its_line_not_left_to_hang(tmp_path):
    with pytest.raises(ddpkit.LaunchError) as caught:
        ddpkit.launch(_main_first_on_rank_0_only, 2, (str(tmp_path / "out"),), start_method=FORKSERVER)
    assert "desync" in str(caught.value) and "(with run.main_first():)" in str(caught.value)
    report = (tmp_path / "out" / "hang-report.txt").read_text()
    assert "phase 'main_first: letting the other ranks into the block (barrier)'" in report
