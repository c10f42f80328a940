"""Run torch's own DDP tests with ``ddpkit.DataParallel`` in place of DistributedDataParallel.

The tests ship in the torch wheel (``torch/testing/_internal/distributed/distributed_test.py``,
class ``DistributedTest._DistTestBase``); this is PyTorch's ``test_distributed_spawn.py`` set-up
(gloo, two ranks, ``TEMP_DIR``, one pair of rank processes per test) with the class swapped.
DataParallel takes torch's arguments in torch's order, so no adapter is needed. Usage::

    python tests/parallel/torch_ddp_runner.py [--engine torch|native] [--json OUT] [--all] [TEST ...]

With no TEST it runs ``torch_ddp_selection.SELECTED``; ``--all`` runs the whole class (about a
minute with forked ranks), and ``DDPKIT_SUITE_MARKS=DIR`` records in DIR which tests construct a
DDP, which is how the selection was found. ``DDPKIT_SUITE_START=spawn`` spawns the ranks as
PyTorch does (8 s a test instead of 0.4). Needs ``expecttest`` (torch's test utilities import it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import unittest

# distributed_test reads these when it is imported, in this process and in each spawned rank.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks on two cores: one thread each
os.environ.setdefault("WORLD_SIZE", "2")
_IMPORT_TEMP_DIR = None if "TEMP_DIR" in os.environ else tempfile.mkdtemp(prefix="ddpkit-torch-ddp-")
os.environ.setdefault("TEMP_DIR", _IMPORT_TEMP_DIR or "")
os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402
from torch_ddp_selection import SELECTED  # noqa: E402

from ddpkit import DataParallel  # noqa: E402

ENGINE = os.environ.setdefault("DDPKIT_SUITE_ENGINE", "native")
MARKS = os.environ.get("DDPKIT_SUITE_MARKS")
START = os.environ.get("DDPKIT_SUITE_START", "fork")  # or "spawn", as test_distributed_spawn.py
_current_test: list[str] = [""]


def _marking(engine: type) -> type:
    """``engine`` that notes, in MARKS, the name of each test that constructs it."""

    class Marking(engine):
        def __init__(self, *args, **kwargs) -> None:
            with open(os.path.join(MARKS, _current_test[0]), "a") as mark:
                mark.write(f"{sorted(kwargs)}\n")
            super().__init__(*args, **kwargs)

    Marking.__name__ = engine.__name__
    return Marking


_engine = DataParallel if ENGINE == "native" else torch.nn.parallel.DistributedDataParallel
if MARKS:
    _engine = _marking(_engine)
# The tests name the class both ways: torch.nn.parallel.DistributedDataParallel and the module's own import.
torch.nn.parallel.DistributedDataParallel = _engine
dt.DistributedDataParallel = _engine


class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """torch's test class, as test_distributed_spawn.py builds it."""

    def setUp(self) -> None:
        super().setUp()
        if START == "spawn":
            self._spawn_processes()
        else:  # forked ranks skip re-importing torch: a few seconds per test on two cores
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs) -> None:
        _current_test[0] = test_name  # in the spawned rank: for MARKS
        super()._run(rank, test_name, file_name, pipe, **kwargs)


class _Recorder(unittest.TextTestResult):
    """Keeps each test's outcome by name, for the JSON summary."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}

    def _note(self, test, outcome: str, detail: str = "") -> None:
        self.outcomes[test._testMethodName] = {"outcome": outcome, "detail": detail[-4000:]}

    def addSuccess(self, test) -> None:
        super().addSuccess(test)
        self._note(test, "passed")

    def addSkip(self, test, reason) -> None:
        super().addSkip(test, reason)
        self._note(test, "skipped", reason)

    def addFailure(self, test, err) -> None:
        super().addFailure(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err) -> None:
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["native", "torch"], default="native")
    parser.add_argument("--json", help="write {test: {outcome, detail}} and the time here")
    parser.add_argument("--all", action="store_true", help="every test of _DistTestBase")
    parser.add_argument("tests", nargs="*", help=f"test names (default: the {len(SELECTED)} selected)")
    args = parser.parse_args(argv)
    if args.engine != ENGINE:  # the ranks read the engine from the environment: start over
        os.environ["DDPKIT_SUITE_ENGINE"] = args.engine
        if _IMPORT_TEMP_DIR:
            shutil.rmtree(_IMPORT_TEMP_DIR, ignore_errors=True)
            del os.environ["TEMP_DIR"]
        os.execv(sys.executable, [sys.executable, __file__, *argv])
    loader = unittest.TestLoader()
    names = loader.getTestCaseNames(TestDistBackendWithSpawn) if args.all else args.tests or SELECTED
    suite = unittest.TestSuite(TestDistBackendWithSpawn(name) for name in names)
    start = time.monotonic()
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2)
    try:
        result = runner.run(suite)
    finally:  # each test makes and removes its own TEMP_DIR; this one only served the import
        if _IMPORT_TEMP_DIR:
            shutil.rmtree(_IMPORT_TEMP_DIR, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"engine": ENGINE, "seconds": time.monotonic() - start, "tests": result.outcomes}, out)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
