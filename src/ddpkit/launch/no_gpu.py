"""A script that asks for CUDA on a machine without it, in one line instead of torch's traceback.

nanoGPT and the DDP tutorials pick ``cuda:{local_rank}`` whenever they run under a launcher:
``torch.cuda.set_device(n)``, ``model.cuda()``, ``torch.device(f"cuda:{n}")``. On a CPU-only
machine (or a CPU build of torch) torch fails deep in its own code with ``AttributeError:
module 'torch._C' has no attribute '_cuda_setDevice'``, ``AssertionError: Torch not compiled
with CUDA enabled`` or ``RuntimeError: Found no NVIDIA driver``. The uncaught-exception hooks
(``uncaught.py``, and ``workerboot`` under ``ddpkit run``) turn those into one line naming the
script's own call and the fix, printed and exited as a ConfigError is (exit code 2).
"""

from __future__ import annotations

import os
import traceback

# What torch says, in one form or another, when CUDA is asked for and is not there.
SIGNS = (
    "Torch not compiled with CUDA enabled",
    "_cuda_setDevice",
    "_cuda_getDeviceCount",
    "Found no NVIDIA driver",
    "No CUDA GPUs are available",
    "no CUDA-capable device",
    "CUDA driver initialization failed",
)


def no_gpu_line(exc: BaseException, tb) -> str | None:
    """The one line for ``exc`` when it is CUDA asked for on a machine without it; else None."""
    text = f"{type(exc).__name__}: {exc}"
    if not any(sign in text for sign in SIGNS):
        return None
    import torch  # loaded already: the exception came from it

    if torch.cuda.is_available():
        return None
    why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible to it"
    return (
        f"the script asks for a GPU{_where(tb)}, but {why} ({text.splitlines()[0][:80]}); run on the "
        "CPU here: use ddpkit.Run's run.device, or pick torch.device('cpu') where the script picks cuda"
    )


def _where(tb) -> str:
    """`` at train.py:52 (torch.cuda.set_device(ddp_local_rank))``: the script's last frame, not torch's."""
    library = (os.path.dirname(os.__file__), os.sep + "site-packages" + os.sep, os.sep + "ddpkit" + os.sep)
    mine = [f for f in traceback.extract_tb(tb) if not any(part in f.filename for part in library)]
    if not mine:
        return ""
    frame = mine[-1]
    code = f" ({frame.line.strip()})" if frame.line else ""
    return f" at {os.path.basename(frame.filename)}:{frame.lineno}{code}"
