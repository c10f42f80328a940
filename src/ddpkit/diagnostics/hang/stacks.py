"""What this process is doing right now: a thread's Python stack, and the collective it waits in."""

from __future__ import annotations

import linecache
import sys
import traceback

from ddpkit.diagnostics.hang.boot_progress import flight_entries


def thread_stack(ident: int) -> str:
    """The formatted Python stack of thread ``ident``, innermost call last.

    Read from another thread through ``sys._current_frames()``: this needs the GIL, which a thread
    blocked in a collective has released (gloo and NCCL waits release it).

    Args:
        ident: ``threading.get_ident()`` of the thread to show.
    """
    frame = sys._current_frames().get(ident)
    if frame is None:
        return "(thread has ended)\n"
    return "".join(traceback.format_stack(frame))


def inflight_op(group_name: str, seq: int) -> str:
    """The op of collective ``seq`` on group ``group_name``, from torch's flight recorder.

    Returns "" when the recorder is off or does not know the collective.

    Args:
        group_name: the process group's ``group_name`` ("0" for the default group).
        seq: the group's sequence number of the collective.
    """
    for entry in reversed(flight_entries(group_name)):
        if entry.get("collective_seq_id") == seq:
            return str(entry.get("profiling_name", ""))
    return ""


# Frames a user does not look for in a hang report: the library calls between their line and the
# collective. The first frame outside these, from the innermost outwards, is the user's line.
_LIBRARIES = frozenset({"ddpkit", "torch"}) | frozenset(sys.stdlib_module_names)


def user_frame(ident: int) -> str:
    """``file:line (source)`` of thread ``ident``'s innermost frame outside ddpkit, torch and the
    standard library (the line of the user's script that is waiting), or "" when there is none.

    Frames are told apart by their module's ``__name__``, not their path, so a script in a folder
    named ``torch`` or ``ddpkit`` still counts as the user's.

    Args:
        ident: ``threading.get_ident()`` of the thread.
    """
    frame = sys._current_frames().get(ident)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".")[0] not in _LIBRARIES:
            path, line = frame.f_code.co_filename, frame.f_lineno
            source = linecache.getline(path, line).strip()
            return f"{path}:{line}" + (f" ({source})" if source else "")
        frame = frame.f_back
    return ""
