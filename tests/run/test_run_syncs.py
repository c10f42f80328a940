"""Issue 33: a Run adds no host sync to a step that neither logs, checks nor checkpoints.

The calls that make the CPU wait for a device (``Tensor.item``, ``tolist``, ``__bool__``, ``cpu``)
are counted around each step of a loop in a world of one; the loop itself makes none. On a GPU,
tests/gpu runs the same steps under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import metric_lines
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.run.monitor.log_gather import device_peak

SYNCING = ("item", "tolist", "__bool__", "cpu")


def _counted(monkeypatch) -> list[int]:
    calls = [0]
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            calls[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls


def test_a_step_that_neither_logs_checks_nor_saves_adds_no_sync(monkeypatch, tmp_path):
    run = ddpkit.Run(
        out=tmp_path / "run", global_batch=8, micro_batch=4, log_every=10, check_every=0, save_every=20,
        progress=False,
    )  # fmt: skip
    model = run.setup(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # AdamW's own step counter calls .item()
    run.track(optimizer)
    data = torch.utils.data.TensorDataset(torch.randn(8 * 25, 6), torch.randn(8 * 25, 1))
    calls, per_step = _counted(monkeypatch), {}
    for x, y in run.loader(data):
        # What ran since the last micro-batch: the loop body, and at a step's first micro-batch
        # the boundary of the step before (its log gather, checkpoint), counted with this step.
        per_step[run.step] = per_step.get(run.step, 0) + calls[0]
        calls[0] = 0
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        run.log(err=(model(x) - y).abs().mean().detach())
        optimizer.step()
    run.finish()
    monkeypatch.undo()
    # Log lines at steps 1, 10, 20 (each gather finished a step later) and a checkpoint at 20:
    # their boundaries land in steps 2-3, 11-12 and 21-22.
    busy = {1, 2, 3, 11, 12, 21, 22}
    assert all(per_step[step] == 0 for step in per_step if step not in busy), per_step
    assert sum(per_step[step] for step in busy) > 0  # the counting sees the log steps' own reads


def test_the_metrics_line_gives_tokens_a_second_and_peak_memory(tmp_path):
    # Token ids (B, T) count as tokens: every token once over the lines' windows, at the rate of
    # each window's own clock. (Against the test's clock it held within 2x, but not on a loaded
    # machine: a timed assertion has no place in the suite.)
    # mfu: the samples' FLOPs over the window's seconds and every device's peak (one here).
    options = {"flops_per_sample": 3e6, "peak_flops": 1e12}
    run = ddpkit.Run(out=tmp_path / "run", global_batch=8, log_every=5, progress=False, **options)
    model = run.setup(nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 12, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    run.track(optimizer)
    data = torch.utils.data.TensorDataset(torch.randint(0, 50, (80, 12)), torch.randn(80, 1))
    for ids, y in run.loader(data):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(ids), y))
        optimizer.step()
    run.finish()
    lines = [line for line in metric_lines(tmp_path / "run") if "loss" in line]
    assert [line["step"] for line in lines] == [1, 5, 10]
    assert all(line["tokens_per_s"] == pytest.approx(12 * line["samples_per_s"]) for line in lines)
    assert sum(line["tokens_per_s"] * line["time_s"] for line in lines) == pytest.approx(80 * 12)
    assert all(line["time_s"] > 0 for line in lines)
    assert all(line["peak_rss_mb"] > 10 for line in lines)
    assert all(line["mfu"] == pytest.approx(line["samples_per_s"] * 3e6 / 1e12) for line in lines)


def test_mfu_needs_a_peak_and_refuses_a_non_positive_count():
    with pytest.raises(ConfigError, match=r"flops_per_sample=0 must be a positive number of FLOPs, or None"):
        ddpkit.Run(flops_per_sample=0)
    assert device_peak(torch.device("cpu"), None) is None  # no mfu on a CPU unless peak_flops is given
    assert device_peak(torch.device("cpu"), 2e12) == 2e12


def test_a_non_finite_gradient_stops_a_step_later_naming_it_before_a_checkpoint(tmp_path):
    # The norm of step 2 is read at step 3's optimizer step: the stop names step 2, and the
    # checkpoint due at step 3 is never written.
    run = ddpkit.Run(out=tmp_path / "run", global_batch=4, log_every=5, save_every=3, progress=False)
    model = run.setup(nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    run.track(optimizer)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randn(40, 1))
    try:
        with pytest.raises(FloatingPointError, match="step 2: the gradient norm is"):
            for x, y in run.loader(data):
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y) * (float("inf") if run.step == 2 else 1.0)
                run.backward(loss)
                optimizer.step()
    finally:
        run.close()
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
