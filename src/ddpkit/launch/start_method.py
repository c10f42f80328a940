"""How ``ddpkit.launch`` starts its processes: spawn when a new interpreter can import what they
run, fork when it cannot (a notebook), and a refusal in one line when fork is not safe.

spawn starts a fresh interpreter that imports ``fn`` (and every class or function in ``args``)
by module and name, and re-runs the caller's ``__main__`` from its file; it works with CUDA
and threads, and it is what ``ddpkit.launch`` always used. A function defined in a notebook
cell lives in a ``__main__`` without a file (Jupyter, IPython, ``python -c``, stdin): spawn's
children die with "Can't get attribute 'work' on <module '__main__' (built-in)>". Those are
forked instead: the child is a copy of this process, the function included.

A forked child cannot use CUDA once its parent has initialized it (torch refuses: "Cannot
re-initialize CUDA in forked subprocess"), so then the launch is refused before anything starts.

``start_method="forkserver"`` is asked for by a caller that launches many times from one process
(a test suite, a notebook's repeated cells): one server process, started at the first launch with
torch and ddpkit imported, forks every later launch's processes, so each starts in milliseconds
instead of seconds of imports. What it runs is pickled as for spawn; the launch hands each
process its environment and working folder as they are at the call (a server started earlier
has its own).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from ddpkit.errors import ConfigError

SPAWN, FORK, FORKSERVER = "spawn", "fork", "forkserver"
# What the forkserver imports once, for every process it forks: torch._dynamo too, which torch
# imports at the first optimizer a process builds (a second of CPU each).
PRELOAD = ["torch", "torch._dynamo", "ddpkit"]


def start_method(fn: Callable[..., Any], args: Sequence[Any] = (), asked: str | None = None) -> str:
    """``"spawn"`` when a new interpreter can import ``fn`` and ``args``, else ``"fork"``; or
    ``asked``'s method, ``"forkserver"`` (with torch and ddpkit preloaded) among them.

    Raises:
        ConfigError: they need fork, and fork cannot give the processes CUDA (already
            initialized here) or does not exist on this platform; or ``asked`` cannot be had.
    """
    if asked is not None:
        return _asked(fn, args, asked)
    if spawn_can_import(fn, args):
        return SPAWN
    name = getattr(fn, "__qualname__", None) or repr(fn)
    if FORK not in mp.get_all_start_methods():
        raise ConfigError(
            f"ddpkit.launch: {name} (or an argument) is defined in __main__ without a file (a notebook "
            "cell), which a new process can only get by fork, and this platform has no fork; move it "
            "to a .py file and import it"
        )
    if torch.cuda.is_initialized():
        raise ConfigError(
            f"ddpkit.launch: {name} (or an argument) is defined in a notebook cell (a __main__ without a "
            "file), so its processes are forked, and CUDA is already initialized in this process, which "
            "forked processes cannot use; restart the kernel and call ddpkit.launch before anything "
            "touches CUDA (torch.cuda calls, .cuda(), .to('cuda')), or move it to a .py file and import it"
        )
    return FORK


def _asked(fn: Callable[..., Any], args: Sequence[Any], asked: str) -> str:
    methods = [m for m in (SPAWN, FORK, FORKSERVER) if m in mp.get_all_start_methods()]
    if asked not in methods:
        raise ConfigError(f"ddpkit.launch(start_method={asked!r}): this platform has {', '.join(methods)}")
    if asked != FORK and not spawn_can_import(fn, args):
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise ConfigError(
            f"ddpkit.launch(start_method={asked!r}): {name} (or an argument) is defined in __main__ "
            "without a file, which only fork can hand to a process; leave start_method unset"
        )
    if asked == FORKSERVER:
        mp.set_forkserver_preload(PRELOAD)  # read when the server starts, at its first launch
    return asked


def spawn_can_import(fn: Callable[..., Any], args: Sequence[Any] = ()) -> bool:
    """Whether spawn's fresh interpreters can rebuild ``fn`` and ``args``.

    A ``__main__`` with a file or a module name (a script, ``python -m``, pytest) is re-run in
    each child, so whatever it defines is found there: spawn, as always. Without one, nothing
    defined in ``__main__`` reaches a child, nor does what pickle cannot send at all (a lambda,
    a function defined inside another); fork sends both, as the child shares this memory.
    """
    main = sys.modules.get("__main__")
    if main is None or main_is_importable(main):
        return True
    try:
        MainFinder(Discard()).dump((fn, tuple(args)))
    except FromMain:
        return False
    except Exception:  # noqa: BLE001 (whatever pickle raises, spawn would raise it too)
        return False
    return True


def main_is_importable(main: object) -> bool:
    """What ``multiprocessing.spawn`` checks to re-run ``__main__`` in a child: a module name, or a file."""
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) is not None or getattr(main, "__file__", None) is not None


class FromMain(Exception):
    """Raised by ``MainFinder`` at the first object that pickle would look up in ``__main__``."""


class MainFinder(pickle.Pickler):
    """A pickler that stops at the first function, class or instance of a class from ``__main__``.

    ``persistent_id`` sees every object pickle saves, the functions and classes it saves by
    reference included, before it saves them.
    """

    def persistent_id(self, obj: Any) -> None:
        if getattr(obj, "__module__", None) == "__main__":
            raise FromMain(obj)
        return None


class Discard:
    """A file that keeps nothing: ``MainFinder`` only walks the objects."""

    def write(self, data: bytes) -> int:
        return len(data)
