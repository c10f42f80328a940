"""``ddpkit.launch`` from a real Jupyter kernel (ipykernel, driven by nbclient), checked from outside.

One kernel runs the cells a user would, in order (the module fixture), beside ``ddpkit run
--nproc 2`` of the same loop as a script:

- torch work on every core first (a fork of a process whose OpenMP pool ran hangs unless the
  launcher forks from a fresh thread), then a function defined in a cell on 2 processes;
- tests/outside/notebook_loop.py as a cell (``train`` lives in the kernel's ``__main__``), and
  ``ddpkit.launch(train, nproc=2, ...)`` straight through, with its progress bar;
- a function whose rank 1 raises;
- ``train`` again into another folder, interrupted by the kernel manager (SIGINT to the kernel's
  process group) once it logged some steps, and then launched once more: it resumes.

The tests read what each cell showed, the weights each run saved, and the processes left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import descendants, logged_losses, saved_weights

nbformat = pytest.importorskip(
    "nbformat", reason="the dev extra's nbclient: pip install -c constraints.txt -e '.[dev]'"
)
nbclient = pytest.importorskip(
    "nbclient", reason="the dev extra's nbclient: pip install -c constraints.txt -e '.[dev]'"
)
pytest.importorskip(
    "ipykernel", reason="the dev extra's ipykernel: pip install -c constraints.txt -e '.[dev]'"
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LOOP = Path(__file__).with_name("notebook_loop.py").read_text()
# docs/notebooks.md's first two Python blocks, as written: the cell defining work, the one launching it.
DOCS_CELLS = re.findall(
    r"```python\n(.*?)```", (Path(__file__).parents[2] / "docs" / "notebooks.md").read_text(), re.S
)[:2]
STEPS = 30  # notebook_loop.py: 3 epochs of 10 global batches
INTERRUPT_AFTER = 6  # metrics lines (one per step) before the kernel is interrupted
PAUSE_S = 0.1  # per step of the interrupted run: time to interrupt it mid-run
CELL_TIMEOUT_S = 240
FOREIGN_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PET_", "DDPKIT_")
FOREIGN_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "NODE_RANK", "OMP_NUM_THREADS"}  # fmt: skip
ANSI = re.compile(r"\x1b\[[0-9;]*m")

CELLS = {
    "warm": "import torch, ddpkit\n"
    "a = torch.randn(1000, 1000)\n"
    "for _ in range(3):\n"
    "    a = torch.tanh(a @ a)  # OpenMP's pool runs on every core in the kernel's main thread",
    "docs-define": DOCS_CELLS[0],
    "docs-launch": DOCS_CELLS[1],
    "loop": LOOP,
    "whole": "print(ddpkit.launch(train, nproc=2, args=({whole!r}, 0.0, True)))",
    "fail": "def fails(n):\n"
    "    env = ddpkit.init_distributed()\n"
    "    if env.rank == 1:\n"
    "        raise ValueError(f'rank one cannot go on with {{n}}')\n"
    "    torch.distributed.barrier()  # rank 0 waits for a rank that is gone\n\n"
    "ddpkit.launch(fails, nproc=2, args=(3,))",
    "interrupted": "ddpkit.launch(train, nproc=2, args=({resumed!r}, {pause}))",
    "resume": "print(ddpkit.launch(train, nproc=2, args=({resumed!r},)))",
}


@dataclass(frozen=True)
class Notebook:
    root: Path
    shown: dict[str, str]  # what each cell showed: its streams and its error's traceback, in order
    errors: dict[str, str]  # each failed cell's exception name
    interrupt_took: float  # seconds from the interrupt to the cell's end
    left_after_interrupt: set[int]  # the kernel's descendants once the interrupted cell ended
    script: subprocess.CompletedProcess


def _env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k not in FOREIGN_NAMES and not k.startswith(FOREIGN_PREFIXES)
    }


def _shown(cell) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback))
        elif "text/plain" in output.get("data", {}):
            parts.append(output["data"]["text/plain"])
    return ANSI.sub("", "".join(parts))


async def _run_cells(client, cells: list, names: list[str], metrics: Path) -> tuple[float, set[int]]:
    """Each cell in turn; the interrupted one is interrupted once ``metrics`` has enough lines."""
    took, left = float("nan"), {-1}
    async with client.async_setup_kernel(env=_env()):
        kernel = client.km.provisioner.process.pid
        for index, name in enumerate(names):
            task = asyncio.create_task(client.async_execute_cell(cells[index], index))
            if name == "interrupted":
                deadline = time.monotonic() + CELL_TIMEOUT_S
                while time.monotonic() < deadline and not task.done():
                    if metrics.exists() and len(metrics.read_text().splitlines()) >= INTERRUPT_AFTER:
                        break
                    await asyncio.sleep(0.05)
                interrupted = time.monotonic()
                await client.km.interrupt_kernel()
                await task
                took, left = time.monotonic() - interrupted, descendants(kernel)
            await task
    return took, left


@pytest.fixture(scope="module")
def notebook(tmp_path_factory) -> Notebook:
    root = tmp_path_factory.mktemp("notebook")
    script = root / "loop_script.py"
    script.write_text(LOOP + "\nimport sys\n\ntrain(sys.argv[1])\n")
    values = {"whole": str(root / "whole"), "resumed": str(root / "resumed"), "pause": PAUSE_S}
    names = list(CELLS)
    sources = [CELLS[n] if n == "loop" or n.startswith("docs") else CELLS[n].format(**values) for n in names]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=True,
        resources={"metadata": {"path": str(root)}},
    )  # fmt: skip
    with open(root / "script.log", "w") as log:  # a file: nobody reads a pipe while the kernel runs
        started = subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "run", "--standalone", "--nproc", "2", str(script),
             str(root / "script")],
            stdout=log, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
    try:
        took, left = asyncio.run(_run_cells(client, nb.cells, names, root / "resumed" / "metrics.jsonl"))
    finally:
        code = started.wait(timeout=CELL_TIMEOUT_S)
    done = subprocess.CompletedProcess(started.args, code, (root / "script.log").read_text())
    shown = {name: _shown(cell) for name, cell in zip(names, nb.cells, strict=True)}
    errors = {name: out.ename for name, cell in zip(names, nb.cells, strict=True) for out in cell.outputs
              if out.output_type == "error"}  # fmt: skip
    return Notebook(root, shown, errors, took, left, done)


def _starts(out: Path) -> list[dict]:
    return [json.loads(line) for line in Path(f"{out}.starts.jsonl").read_text().splitlines()]


def _assert_same_run(notebook: Notebook, name: str) -> None:
    assert notebook.script.returncode == 0, notebook.script.stdout[-4000:]
    reference, other = saved_weights(notebook.root / "script"), saved_weights(notebook.root / name)
    assert other.keys() == reference.keys()
    differ = [k for k in reference if not torch.equal(other[k], reference[k])]
    assert not differ, f"the notebook's {name} run ends with other weights than ddpkit run's in {differ}"
    losses = logged_losses(notebook.root / name)
    assert losses == logged_losses(notebook.root / "script"), f"the notebook's {name} run logged other losses"
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    threads = {s["threads"] for s in _starts(notebook.root / "script")}
    assert {s["threads"] for s in _starts(notebook.root / name)} == threads  # float sums depend on it


def test_the_docs_function_from_a_cell_runs_on_two_processes_as_written(notebook):
    assert not {"docs-define", "docs-launch"} & set(notebook.errors), notebook.shown
    assert notebook.shown["docs-launch"].strip().splitlines()[-1] == "[30.0, 30.0]"  # 10 * 1 + 10 * 2


def test_a_run_loop_in_a_cell_equals_ddpkit_run(notebook):
    shown = notebook.shown["whole"]
    assert "whole" not in notebook.errors, shown
    assert shown.strip().splitlines()[-1] == f"[{STEPS}, {STEPS}]"
    # Rank 0's log lines and progress bar reach the cell; no other rank's.
    assert "[rank 0] INFO ddpkit.run.step.boundary: 8 checkpoint(s) written" in shown, shown[-2000:]
    assert "[rank 1]" not in shown, shown[-2000:]
    assert "epoch 2: 100%|██████████| 10/10" in shown, shown[-2000:]
    _assert_same_run(notebook, "whole")


def test_a_failing_rank_shows_its_traceback_once(notebook):
    assert notebook.errors.get("fail") == "LaunchError"
    shown = notebook.shown["fail"]
    assert shown.count("ValueError: rank one cannot go on with 3") == 1, shown
    assert "LaunchError: rank 1 failed: Traceback (most recent call last):" in shown, shown


def test_an_interrupted_cell_stops_every_rank_and_the_next_launch_resumes_exactly(notebook):
    shown = notebook.shown["interrupted"]
    assert notebook.errors.get("interrupted") == "KeyboardInterrupt", shown
    assert "ddpkit: preempted by SIGINT at step" in shown and "(checkpoint written)" in shown, shown
    assert "stopped by SIGINT: 2 workers exited" in shown and "with exit code 130" in shown, shown
    assert "During handling" not in shown, shown  # one exception: the launcher's own signal is not chained
    assert notebook.interrupt_took < 15, (
        f"{notebook.interrupt_took:.1f} s from the interrupt to the cell's end"
    )
    assert not notebook.left_after_interrupt, f"left running in the kernel: {notebook.left_after_interrupt}"
    # The second launch started where the first stopped, and ended as the uninterrupted run did.
    stopped_at = int(re.search(r"preempted by SIGINT at step (\d+)", shown).group(1))
    assert 1 <= stopped_at < STEPS
    assert "resumed from" in notebook.shown["resume"] and f"at step {stopped_at}" in notebook.shown["resume"]
    firsts = sorted((s["rank"], s["first_step"]) for s in _starts(notebook.root / "resumed"))
    assert firsts == [(0, 1), (0, stopped_at + 1), (1, 1), (1, stopped_at + 1)], firsts
    _assert_same_run(notebook, "resumed")
