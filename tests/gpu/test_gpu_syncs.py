"""Issue 33 on a GPU: a step that neither logs, checks nor checkpoints makes no host sync (the
non-finite check reads each norm from pinned memory a step later; tests/run/test_run_syncs.py
holds the stop itself on the CPU).

torch's sync debug mode raises on any call that makes the CPU wait for cuda:0; it is on around
the steps between log lines, checks and checkpoints.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_quiet_steps_run_under_the_sync_debug_mode_error(tmp_path):
    # The with block closes the run (and its process group) if a step fails.
    with ddpkit.Run(
        out=tmp_path / "run", global_batch=8, micro_batch=4, log_every=10, check_every=0, save_every=20,
        progress=False,
    ) as run:  # fmt: skip
        model = run.setup(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        run.track(optimizer)
        data = TensorDataset(torch.randn(8 * 25, 6), torch.randn(8 * 25, 1))
        quiet = 0
        try:
            for x, y in run.loader(data):
                # Steps 4-9 and 14-19: their boundaries neither log nor checkpoint (see test_run_syncs).
                strict = run.step % 10 in range(4, 10)
                torch.cuda.set_sync_debug_mode("error" if strict else "default")
                optimizer.zero_grad()
                run.backward(F.mse_loss(model(x), y))
                optimizer.step()
                quiet += strict
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert quiet > 10


def test_a_signal_on_a_gpu_stops_the_run_at_an_agreed_step_with_its_checkpoint(tmp_path):
    # On a GPU the ranks' agreement on a signal is read one agreement later (run/step/preempt.py), so
    # that it makes no host sync: the stop comes within two agreements (at most every log_every=4
    # steps), at a step boundary, with that step's checkpoint, and the exit code of the signal.
    data = TensorDataset(torch.randn(8 * 30, 6), torch.randn(8 * 30, 1))
    with pytest.raises(SystemExit) as stopped:
        with ddpkit.Run(out=tmp_path / "run", global_batch=8, log_every=4, progress=False) as run:
            model = run.setup(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            run.track(optimizer)
            for x, y in run.loader(data):
                if run.step == 5:
                    os.kill(os.getpid(), signal.SIGTERM)
                optimizer.zero_grad()
                run.backward(F.mse_loss(model(x), y))
                optimizer.step()
    assert stopped.value.code == 128 + signal.SIGTERM
    saved = [int(path.name.split("-")[1]) for path in (tmp_path / "run" / "checkpoints").glob("step-*")]
    assert saved and 5 < max(saved) <= 5 + 2 * 4 + 1, saved
