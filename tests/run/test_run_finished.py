"""A finished run, run again: a command that cannot train it further (the same one, or a steps=
no higher than the step it finished at) is one line from rank 0 and exit code 0 at ddpkit.Run(),
before the script's code after its loop; nothing in OUT is written. Another command whose loop
runs no step (no more epochs) runs that code, and run.finish() writes nothing and makes no
collective, so a rank whose code failed leaves the others nothing to wait for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ddpkit_run
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.run.state import checkpoints

SCRIPT = Path(__file__).with_name("finished_script.py")


def _files(out: Path) -> dict[Path, tuple[bytes, int]]:
    """Every checkpoint file and OUT/model.pt: their bytes and modification times."""
    paths = [p for p in sorted((out / "checkpoints").rglob("*")) if p.is_file()] + [out / "model.pt"]
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


def _train(out: Path, steps: int | None = None) -> torch.optim.Optimizer:
    """Two epochs of 4 steps, or ``steps``; a rerun whose loop runs no step is left as it was."""
    run = ddpkit.Run(out=out, global_batch=4, save_every=3, steps=steps, progress=False)
    torch.manual_seed(0)
    model = run.setup(nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    run.track(optimizer)
    loader = run.loader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)))
    for _ in range(loader.epoch, 2):
        for x, y in loader:
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
    run.finish()
    return optimizer


def _another_command(monkeypatch) -> None:
    monkeypatch.setattr(checkpoints, "this_process", lambda: -1)  # another process than the first
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--report-to", "none"])  # with another flag


def test_a_spent_step_limit_ends_another_command_at_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _train(out, steps=6)
    before = _files(out)
    _another_command(monkeypatch)
    with pytest.raises(SystemExit) as done:
        _train(out, steps=6)
    assert done.value.code == 0 and _files(out) == before
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"ddpkit: {out} holds a finished run (step 6) and steps=6 asks for no more; nothing to do: "
        "to train further pass steps= above 6, or use another out to start over"
    )
    _train(out, steps=7)  # a higher limit trains on
    assert "resumed from" in capsys.readouterr().out


def test_another_command_that_trains_no_step_leaves_the_run_as_it_was(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    trained = _train(out).state_dict()
    before = _files(out)
    _another_command(monkeypatch)

    def collective(*args, **kwargs):
        raise AssertionError("a collective in run.finish() of a run that trained nothing")

    monkeypatch.setattr(checkpoints, "check_replicas_agree", collective)
    monkeypatch.setattr("ddpkit.run.run.save_final", collective)
    resumed = _train(out).state_dict()  # the loop over epochs 2 to 2 runs no step
    assert _files(out) == before
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"ddpkit: {out} holds a finished run (step 8) and this command trained no step, so it is left "
        "as it was: to train further raise the loop's epochs above 2, or use another out to start over"
    )
    assert torch.equal(resumed["state"][0]["exp_avg"], trained["state"][0]["exp_avg"])  # restored


@pytest.mark.slow
def test_the_finished_run_of_an_hf_loop_run_again_is_one_line_and_exit_0(tmp_path):
    # run_clm_no_trainer's shape: the budget stops the loop mid-epoch, run.save() follows at the
    # epoch's end, and after the loop rank 0 reads the loop's last loss: on a rerun there is none,
    # and rank 1 once sat in run.finish()'s collectives when rank 0 failed (gloo's "Connection
    # closed by peer", ~150 lines).
    out = tmp_path / "run"
    ddpkit_run(SCRIPT, out, 2, "--max-train-steps", "7")
    before = _files(out)
    again = ddpkit_run(SCRIPT, out, 2, "--max-train-steps", "7", "--report-to", "none")
    both = again.stdout + again.stderr
    line = (
        f"ddpkit: {out} holds a finished run (step 7) and steps=7 asks for no more; nothing to do: "
        "to train further pass steps= above 7, or use another out to start over"
    )
    assert both.count(line) == 1, both[-3000:]
    assert "Traceback" not in both and "Connection closed" not in both, both[-3000:]
    assert _files(out) == before
