"""The values a user spells as strings for the process group and the engine, and their checks.

A leaf: it imports nothing of ddpkit but ``ddpkit.errors``, and nothing of torch, so
``run/config.py`` checks a backend or a compression string without loading the engine. The
runtime reads the same names from here: ``dist/init.py`` its backends, ``parallel/compression.py``
its compressions and the PowerSGD string, ``parallel/powersgd.py`` the range of its settings.
"""

from __future__ import annotations

from ddpkit.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl", "mpi")
COMPRESSIONS = ("bf16", "fp16", "powersgd")  # and powersgd:RANK[:START_ITER]

# PowerSGD's defaults: torch's rank; fewer plain steps than torch's 1000, which is for long runs.
POWERSGD_RANK = 1
POWERSGD_START_ITER = 10


def check_powersgd(
    matrix_approximation_rank: int = POWERSGD_RANK,
    start_iter: int = POWERSGD_START_ITER,
    error_feedback: bool = True,
    warm_start: bool = True,
) -> None:
    """Refuse PowerSGD settings it cannot run with, naming the value and the fix.

    Args:
        matrix_approximation_rank: the rank of the approximation; at least 1.
        start_iter: plain all-reduce steps before compressing; above 1 with error feedback or a
            warm start.
        error_feedback: whether what the approximation missed is added to the next step.
        warm_start: whether each step's power iteration starts from the last step's Q.
    """
    if matrix_approximation_rank < 1:
        raise ConfigError(
            f"PowerSGD matrix_approximation_rank {matrix_approximation_rank} must be at least 1, "
            "for example matrix_approximation_rank=1"
        )
    if start_iter <= 1 and (error_feedback or warm_start):
        raise ConfigError(
            f"PowerSGD start_iter {start_iter} must be > 1 with error feedback or warm start: "
            "the first synchronized step runs before the buckets are rebuilt; use start_iter=2 or more"
        )


def powersgd_settings(spec: str) -> dict[str, int]:
    """``"powersgd"``, ``"powersgd:RANK"`` or ``"powersgd:RANK:START_ITER"`` as PowerSGD's
    keyword arguments (those the string gives), checked.

    Args:
        spec: the string; RANK is ``matrix_approximation_rank`` (default 1, torch's), START_ITER
            the plain all-reduce steps before compressing (default 10, torch's 1000 is for long runs).
    """
    name, *numbers = spec.split(":")
    if name != "powersgd" or len(numbers) > 2 or not all(n.isascii() and n.isdigit() for n in numbers):
        raise ConfigError(
            f"bad PowerSGD compression {spec!r}; use powersgd, powersgd:RANK or "
            "powersgd:RANK:START_ITER with whole numbers, for example powersgd:4 or powersgd:4:50"
        )
    fields = ("matrix_approximation_rank", "start_iter")
    settings = {field: int(n) for field, n in zip(fields, numbers, strict=False)}
    try:
        check_powersgd(**settings)
    except ConfigError as err:  # rank 0 or start_iter 1: say which string held it
        raise ConfigError(f"compression {spec!r}: {err}") from None
    return settings
