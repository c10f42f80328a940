"""What this process is doing right now: a thread's Python stack, and the collective it waits in."""

from __future__ import annotations

import linecache
import logging
import pickle
import sys
import traceback

log = logging.getLogger(__name__)


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


def flight_entries(group_name: str) -> list[dict]:
    """The flight recorder's entries of group ``group_name``'s collectives, oldest first.

    The recorder keeps the last collectives of every group (on by default for gloo and NCCL in
    torch 2.13; TORCH_FR_BUFFER_SIZE sets how many, 2000 by default). A dump takes about 0.2 ms
    with a few entries and some 50 ms with 2000, so it is taken when a rank has been idle a while
    or a hang is being reported, never per step. Point-to-point entries are left out: a send and
    its recv share a sequence number under different names. Returns [] when the recorder is off
    or unavailable.

    Args:
        group_name: the process group's ``group_name`` ("0" for the default group).
    """
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    except Exception as exc:  # private API: a missing or changed recorder only costs the op name
        log.debug("flight recorder unavailable: %s", exc)
        return []
    ours = [
        entry
        for entry in entries.get("entries", [])
        if entry.get("process_group", ("",))[0] == group_name and not entry.get("is_p2p", False)
    ]
    return sorted(ours, key=lambda entry: entry.get("record_id", 0))  # a wrapped ring, in order


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
