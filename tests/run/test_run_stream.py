"""Streaming data on ddpkit.Run (tests/run/stream_script.py): what each kind of source promises.

- a HuggingFace IterableDataset with state (2 DataLoader workers): a kill-and-rerun is bit-equal;
- a ddpkit.data.Shards source: the same losses on 1, 2 and 3 processes, and a run killed on 2
  and resumed on 3 goes on with the samples it would have used next;
- a plain stream without state: a resumed run says once that it starts the stream over;
- uneven shares at the end of a pass: every rank stops at the last full global batch.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ddpkit_run, logged_losses, run_ranks, saved_weights
from torch.utils.data import IterableDataset

import ddpkit

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("stream_script.py")


def _run(out: Path, nproc: int, *extra: str, code: int = 0) -> subprocess.CompletedProcess:
    return ddpkit_run(SCRIPT, out, nproc, *extra, code=code, timeout=240)


def test_a_huggingface_stream_killed_and_rerun_is_bit_equal(tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("torchdata")
    _run(tmp_path / "whole", 2, "--source", "hf")
    _run(tmp_path / "cut", 2, "--source", "hf", "--kill-at", "6", code=1)
    done = _run(tmp_path / "cut", 2, "--source", "hf")
    assert "resumed from" in done.stdout and "step-00000004" in done.stdout
    whole, cut = saved_weights(tmp_path / "whole"), saved_weights(tmp_path / "cut")
    assert all(torch.equal(cut[k], v) for k, v in whole.items()), "the rerun's model differs"
    assert logged_losses(tmp_path / "cut") == logged_losses(tmp_path / "whole")
    assert len(logged_losses(tmp_path / "whole")) == 16  # 2 passes of 8 full global batches of 12


def test_a_shard_source_is_world_size_invariant_and_resumes_on_another_world_size(tmp_path):
    runs = {n: tmp_path / f"on{n}" for n in (1, 2, 3)}
    for nproc, out in runs.items():
        _run(out, nproc, "--source", "shards")
    reference = logged_losses(runs[1])
    assert len(reference) == 18  # 2 epochs of 100 samples in global batches of 12 (the last of 4)
    for nproc in (2, 3):
        assert logged_losses(runs[nproc]) == pytest.approx(reference, rel=1e-5), nproc
    moved = tmp_path / "2to3"
    _run(moved, 2, "--source", "shards", "--kill-at", "6", code=1)
    _run(moved, 3, "--source", "shards")
    assert logged_losses(moved) == pytest.approx(reference, rel=1e-5)
    for key, value in saved_weights(runs[2]).items():
        torch.testing.assert_close(saved_weights(moved)[key], value, rtol=1e-5, atol=1e-6)


def test_a_plain_stream_resumed_says_once_that_it_starts_over(tmp_path):
    _run(tmp_path / "cut", 2, "--source", "plain", "--kill-at", "6", code=1)
    done = _run(tmp_path / "cut", 2, "--source", "plain")
    assert done.stderr.count("has no state_dict(), so this resumed run reads it from its beginning") == 1
    assert [
        json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    ][4] == 5


class _Count(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor([1.0])


def _uneven(env, n: int) -> tuple[int, int]:
    run = ddpkit.Run(global_batch=12, progress=False)
    model = run.setup(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(optimizer)
    loader = run.loader(_Count(n))
    with pytest.raises(TypeError, match="a stream has no length"):
        len(loader)
    for x, y in loader:
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
    steps = run.step
    run.finish()
    return steps, loader.epoch


def test_uneven_shares_end_every_rank_at_the_last_full_global_batch():
    # 95 samples, every 2nd to each rank: rank 0 has 48 (8 shares of 6), rank 1 has 47 (7 and 5 left).
    assert run_ranks(_uneven, 2, 95) == [(7, 1), (7, 1)]
