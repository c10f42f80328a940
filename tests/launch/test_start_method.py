"""ddpkit.launch's start method: spawn for what a new interpreter can import, fork for a notebook
cell's function, and one line when fork cannot give the processes CUDA."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.launch import start_method as chooser
from ddpkit.launch.start_method import FORK, SPAWN, start_method


def importable(n: int) -> int:
    return n


@pytest.fixture
def notebook_main(monkeypatch):
    """``__main__`` as a Jupyter kernel has it: a module with neither a file nor a module name."""
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def _from_cell(main: types.ModuleType):
    """A function and a class defined in a cell: their ``__module__`` is ``__main__``."""
    namespace = {"__name__": "__main__"}
    exec("def work(n):\n    return n\n\nclass Net:\n    pass\n", namespace)
    main.__dict__.update(namespace)
    return namespace["work"], namespace["Net"]


def test_a_script_spawns_as_before(monkeypatch):
    # A script's __main__ has a file: whatever it defines, spawn's children re-import it. (Set here:
    # an xdist worker's own __main__ is execnet's, without one.)
    script = types.ModuleType("__main__")
    script.__file__ = "/work/train.py"
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert start_method(importable, (1,)) == SPAWN
    assert start_method(lambda n: n) == SPAWN  # as before: spawn's own pickling error names it


def test_a_cell_function_or_argument_is_forked(notebook_main):
    work, net = _from_cell(notebook_main)
    assert start_method(work, (1,)) == FORK
    assert start_method(importable, (net(),)) == FORK  # an instance of a cell's class
    assert start_method(importable, ({"model": [net]},)) == FORK  # found however deep
    assert start_method(lambda n: n) == FORK  # pickle cannot send it at all; fork can


def test_an_imported_function_spawns_from_a_notebook(notebook_main):
    assert start_method(importable, (1, torch.zeros(2))) == SPAWN


def test_cuda_initialized_refuses_fork_in_one_line(notebook_main, monkeypatch):
    work, _ = _from_cell(notebook_main)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match=r"^ddpkit.launch: work .* restart the kernel") as info:
        ddpkit.launch(work, 2)
    assert "\n" not in str(info.value)
    # Spawn gives each process its own CUDA: an imported function still launches.
    assert start_method(importable) == SPAWN


def test_no_fork_on_this_platform_says_so(notebook_main, monkeypatch):
    work, _ = _from_cell(notebook_main)
    monkeypatch.setattr(chooser.mp, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ConfigError, match="this platform has no fork; move it to a .py file"):
        start_method(work)


def where_and_what(key: str) -> tuple[str, str | None, int]:
    import os

    return os.getcwd(), os.environ.get(key), os.getppid()


def test_a_forkserver_launch_hands_each_process_the_callers_environment_and_folder(tmp_path, monkeypatch):
    import os

    # The server may have started at an earlier test's launch, with that moment's variables and
    # folder: each launch hands its own.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPKIT_TEST_MARK", "given at the call")
    results = ddpkit.launch(where_and_what, 2, ("DDPKIT_TEST_MARK",), start_method="forkserver")
    assert [r[:2] for r in results] == [(str(tmp_path), "given at the call")] * 2
    assert all(parent != os.getpid() for _, _, parent in results)  # the server's children, not ours


def test_a_start_method_that_cannot_be_had_is_one_line(notebook_main, monkeypatch):
    with pytest.raises(
        ConfigError, match=r"start_method='thread'\): this platform has spawn, fork, forkserver"
    ):
        start_method(importable, (1,), asked="thread")
    work, _ = _from_cell(notebook_main)
    with pytest.raises(ConfigError, match="only fork can hand to a process; leave start_method unset"):
        start_method(work, (1,), asked="forkserver")
