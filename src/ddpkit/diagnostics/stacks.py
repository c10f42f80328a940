"""What this process is doing right now: a thread's Python stack, and the collective it waits in."""

from __future__ import annotations

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


def inflight_op(group_name: str, seq: int) -> str:
    """The op of collective ``seq`` on group ``group_name``, from torch's flight recorder.

    The recorder keeps the last collectives of every group (on by default for gloo and NCCL in
    torch 2.13; TORCH_FR_BUFFER_SIZE sets how many). Dumping it can take a fraction of a second,
    so this is called once, when a hang is being reported, never per step. Returns "" when the
    recorder is off or does not know the collective.

    Args:
        group_name: the process group's ``group_name`` ("0" for the default group).
        seq: the group's sequence number of the collective.
    """
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    except Exception as exc:  # private API: a missing or changed recorder only costs the op name
        log.debug("flight recorder unavailable: %s", exc)
        return ""
    for entry in reversed(entries.get("entries", [])):
        group = entry.get("process_group", ("",))[0]
        if group == group_name and entry.get("collective_seq_id") == seq:
            return str(entry.get("profiling_name", ""))
    return ""
