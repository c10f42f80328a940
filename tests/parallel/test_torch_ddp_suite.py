"""torch's own DDP tests, run with ``ddpkit.DataParallel`` in place of DistributedDataParallel.

The tests ship in the torch wheel (``torch/testing/_internal/distributed/distributed_test.py``,
class ``DistributedTest._DistTestBase``, 285 tests). ``torch_ddp_runner.py`` runs them as
PyTorch's ``test_distributed_spawn.py`` does (gloo, world size 2, ``TEMP_DIR``), with the class
swapped; DataParallel takes torch's arguments in torch's order, so there is no adapter at all.

Which tests: on this CPU machine 195 of the 285 skip themselves (they need GPUs, NCCL or MPI)
and 90 run; 11 of those construct a DDP (``torch_ddp_runner.py --all`` with
``DDPKIT_SUITE_MARKS``). This file runs 9 of them in one subprocess (about 10 s), and each
must pass; with ``--engine torch`` the same 9 pass under torch's own DDP:

    test_DistributedDataParallelCPU, test_DistributedDataParallelCPU_grad_is_view,
    test_DistributedDataParallel_requires_grad, test_accumulate_gradients_no_sync,
    test_accumulate_gradients_no_sync_allreduce_hook,
    test_accumulate_gradients_no_sync_allreduce_with_then_hook,
    test_accumulate_gradients_no_sync_grad_is_view, test_ddp_create_graph,
    test_grads_same_across_ranks_with_no_sync

Excluded (2), because they test DDP's private internals (``torch_ddp_selection.EXCLUDED``):

    test_ddp_logging_data_cpu: sets and reads DDP's private logging record
        (_set_ddp_runtime_logging_sample_rate, _get_ddp_logging_data)
    test_static_graph_api_cpu: calls the private _set_static_graph() after training and checks
        that _get_ddp_logging_data recorded the error

``torch_ddp_runner.py --all`` runs the whole class in about a minute: 88 pass (the 9 above
and 79 that never construct a DDP: collectives and utilities), 195 skip, and the only 2 errors
are those two. The ranks are forked rather than spawned: a spawned rank re-imports torch and
the 11,000-line test module, 8 s a test on two cores instead of 0.4.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch_ddp_selection import EXCLUDED, SELECTED

pytestmark = pytest.mark.slow

pytest.importorskip("expecttest", reason="torch's distributed test utilities import expecttest")

RUNNER = Path(__file__).with_name("torch_ddp_runner.py")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("torch-ddp") / "outcomes.json"
    run = subprocess.run(
        [sys.executable, str(RUNNER), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.exists(), f"the runner wrote no result:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(out.read_text())["tests"]


@pytest.mark.parametrize("name", SELECTED)
def test_torch_ddp_test_passes_with_data_parallel(outcomes: dict, name: str) -> None:
    result = outcomes.get(name, {"outcome": "not run", "detail": ""})
    assert result["outcome"] == "passed", f"{name}: {result['outcome']}\n{result['detail']}"


def test_the_excluded_tests_exist_and_are_not_run(outcomes: dict) -> None:
    import torch.testing._internal.distributed as package

    source = (Path(package.__file__).parent / "distributed_test.py").read_text()
    for name in EXCLUDED:
        assert f"def {name}(" in source, f"{name} is no longer in torch's suite; update the selection"
        assert name not in outcomes
