"""A collective only some ranks call, in a user's own loop on ddpkit.Run under `ddpkit run`.

No flag: the watchdog's default desync_s (30 s) must report it long before the 30-minute
collective timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ddpkit_popen

pytestmark = pytest.mark.slow

# The single-device way, plus the classic bug: a checkpoint (a collective: every rank's RNG states
# are gathered) on rank 0 only, while rank 1 goes on to the next epoch's gradient all-reduce.
SAVE_ON_RANK_0 = textwrap.dedent(
    """
    import sys, time
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset
    import ddpkit

    run = ddpkit.Run(out=sys.argv[1], global_batch=8, log_every=1, progress=False)
    model = run.setup(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    g = torch.Generator().manual_seed(0)
    loader = run.loader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)))
    for epoch in range(2):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
        if epoch == 0:
            open(sys.argv[2], "w").write(str(time.time()))  # for the test: when the ranks part
            if run.env.rank == 0:
                run.save()
    run.finish()
    """
)


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


# A rank-0-only all_reduce of another size meeting the gradient one: gloo aborts a rank at once.
ALL_REDUCE_ON_RANK_0 = _edit(
    _edit(SAVE_ON_RANK_0, "        if run.env.rank == 0:\n            run.save()\n", ""),
    "        run.backward(loss)\n",
    "        if run.step == 3 and run.env.rank == 0:\n"
    "            torch.distributed.all_reduce(torch.ones(1000))\n"
    "        run.backward(loss)\n",
)


@pytest.fixture(autouse=True)
def launcher_files_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _ddpkit_run(tmp_path, script_text: str, limit: float = 150) -> tuple[int, str, float]:
    """`ddpkit run --nproc 2 script.py OUT MARK` with no other flag: exit code, stderr, end time."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script), str(tmp_path / "out")]
    proc = ddpkit_popen(
        [*cmd, str(tmp_path / "parted")], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"still running after {limit} s:\n{err[-3000:]}") from None
    return proc.returncode, err, time.time()


def _line(text: str, code: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if line.strip() == code)


def test_a_checkpoint_on_rank_0_only_is_reported_as_a_desync_within_60_s(tmp_path):
    code, err, ended = _ddpkit_run(tmp_path, SAVE_ON_RANK_0)
    parted = float((tmp_path / "parted").read_text())
    assert code != 0 and ended - parted < 60, err[-3000:]
    last = err.strip().splitlines()[-1]
    save = _line(SAVE_ON_RANK_0, "run.save()")
    assert "desync (a collective only some ranks called): rank 0 is in gloo:all_gather" in last, err[-3000:]
    assert f"script.py:{save} (run.save()); rank 1 is in gloo:all_reduce" in last
    assert f"script.py:{_line(SAVE_ON_RANK_0, 'run.backward(loss)')} (run.backward(loss))" in last
    text = (tmp_path / "out" / "hang-report.txt").read_text()
    summary = last[last.index("desync") : last.index("; the report")]
    assert text.splitlines()[0] == f"ddpkit hang report: {summary}"
    assert "stack of rank 0" in text and "in save" in text and "stack of rank 1" in text
    assert err.count("ddpkit hang report:") == 1  # one report, from one rank


def test_a_mismatch_gloo_rejects_at_once_is_reported_once_by_gloo(tmp_path):
    code, err, _ = _ddpkit_run(tmp_path, ALL_REDUCE_ON_RANK_0)
    assert code == 1 and "Is there a distributed collective mismatch in your code?" in err, err[-3000:]
    assert "hang report" not in err and "desync" not in err  # no second report after gloo's
    assert not (tmp_path / "out" / "hang-report.txt").exists()
