"""A ConfigError in a user's own script on ddpkit.Run: one line under `ddpkit run` and under torchrun.

`ddpkit run` prints exactly one line on stderr (rank 0's error if it raised one, else the lowest
rank's) and exits with code 2; under torchrun each worker that speaks prints one line, with exit
code 2, and only rank 0 speaks when every rank raised. Other errors keep their traceback.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ddpkit_cli

pytestmark = pytest.mark.slow

# Written the single-device way, with a global batch of 10 that 3 processes cannot split.
SPLIT_SCRIPT = textwrap.dedent(
    """
    import torch, ddpkit
    from torch.utils.data import TensorDataset

    run = ddpkit.Run(global_batch=10)
    model = run.setup(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    for x, y in run.loader(TensorDataset(torch.randn(40, 4), torch.randn(40, 1))):
        optimizer.zero_grad()
        run.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    run.finish()
    """
)
RANK1_MESSAGE = "rank 1 holds no samples; give every rank a shard"
SPLIT_LINE = (
    "ddpkit: error: global_batch=10 cannot be split evenly across 3 processes; "
    "use a global batch that is a multiple of 3, or a world size in [1, 2, 5, 10]"
)

# Rank 1 alone raises, while the others wait for it in run.setup's first collective.
RANK1_SCRIPT = textwrap.dedent(
    """
    import sys, torch, ddpkit
    from ddpkit.errors import ConfigError

    run = ddpkit.Run(global_batch=12)
    if run.env.rank == 1:
        if sys.argv[1] == "config":
            raise ConfigError(sys.argv[2])
        raise RuntimeError("a real bug on rank 1")
    model = run.setup(torch.nn.Linear(4, 1))
    run.finish()
    """
)

UNUSED_SCRIPT = textwrap.dedent(
    """
    import torch, ddpkit
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.body(x).sum(1, keepdim=True)  # head is never used

    run = ddpkit.Run(global_batch=4, progress=False)
    model = run.setup(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    for x, y in run.loader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))):
        optimizer.zero_grad()
        run.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    run.finish()
    """
)


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


def _ddpkit_run(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc", str(nproc), script, *args]
    return ddpkit_cli(command, capture_output=True, text=True, timeout=180)


def _torchrun(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), script, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize(
    ("text", "args", "line"),
    [
        (SPLIT_SCRIPT, (), SPLIT_LINE),
        (RANK1_SCRIPT, ("config", RANK1_MESSAGE), f"ddpkit: error: {RANK1_MESSAGE}"),
    ],
    ids=["every-rank", "rank-1-only"],
)
def test_ddpkit_run_prints_a_config_error_as_one_line(tmp_path, text, args, line):
    done = _ddpkit_run(3, _script(tmp_path, text), *args)
    assert (done.returncode, done.stderr) == (2, line + "\n")


def test_ddpkit_run_prints_an_unused_parameter_as_one_line(tmp_path):
    done = _ddpkit_run(2, _script(tmp_path, UNUSED_SCRIPT))
    assert done.returncode == 2, done.stderr
    names = r"2 parameter\(s\) of Net \('head.weight', 'head.bias'\)"
    assert re.fullmatch(rf"ddpkit: error: {names} got no gradient.*\n", done.stderr), done.stderr
    assert "ddpkit.Run(find_unused_parameters=True)" in done.stderr


def test_ddpkit_run_keeps_the_traceback_of_other_errors(tmp_path):
    done = _ddpkit_run(2, _script(tmp_path, RANK1_SCRIPT), "bug")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: a real bug on rank 1" in done.stderr


@pytest.mark.parametrize(
    ("text", "args", "line"),
    [
        (SPLIT_SCRIPT, (), SPLIT_LINE),
        (RANK1_SCRIPT, ("config", RANK1_MESSAGE), f"ddpkit: error: rank 1: {RANK1_MESSAGE}"),
    ],
    ids=["every-rank", "rank-1-only"],
)
def test_torchrun_gets_one_line_per_config_error_and_no_traceback(tmp_path, text, args, line):
    script = _script(tmp_path, text)
    done = _torchrun(3, script, *args)
    assert done.returncode == 1  # torchrun's own, for any failed worker
    # ddpkit's lines by their form, not by the word: torchrun's own lines name the interpreter's
    # path, which holds "ddpkit" whenever the venv lives in a clone named ddpkit.
    ours = [entry for entry in done.stderr.splitlines() if entry.startswith(("ddpkit:", "[rank"))]
    assert ours == [line], done.stderr  # no other rank's line
    # No worker's traceback: any would have a frame in the script (torchrun's own is in torch).
    assert f'File "{script}"' not in done.stderr, done.stderr
    assert re.search(r"exitcode\s*: 2 ", done.stderr), done.stderr  # torchrun's summary of the first
