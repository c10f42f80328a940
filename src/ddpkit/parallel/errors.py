"""Errors of the engine, typed as torch's DDP types them, so code that catches torch's still works.

``ConfigError`` (a ``ValueError``) is what the ddpkit CLI prints as one line; where torch's DDP
raises ``RuntimeError`` for the same mistake, ``DataParallelError`` is both.
"""

from ddpkit.errors import ConfigError


class DataParallelError(ConfigError, RuntimeError):
    """A user mistake for which torch's DistributedDataParallel raises ``RuntimeError``.

    For example a module with no parameter that requires grad, ranks that hold different models,
    or a parameter that got no gradient without ``find_unused_parameters=True``.
    """


def unfinished_pass(missing: list[str]) -> DataParallelError:
    """The error for a backward pass in which ``missing`` parameters got no gradient; it keeps
    their names in ``missing``, for callers that word the fix their own way (``ddpkit.Run``)."""
    error = DataParallelError(
        f"DataParallel: {len(missing)} parameter(s) got no gradient in the last backward pass, "
        f"so their buckets were never reduced: {', '.join(missing[:8])}"
        f"{' ...' if len(missing) > 8 else ''}. Pass find_unused_parameters=True to "
        "DataParallel if the model leaves some parameters out of the loss, or remove them"
    )
    error.missing = list(missing)
    return error


def ready_too_often(name: str, fired: int, expected: int) -> RuntimeError:
    """The error for a parameter whose gradient hook fired more often than one pass allows."""
    return RuntimeError(
        f"DataParallel: parameter {name!r} received a gradient more often than expected "
        f"({fired} > {expected}) in one backward pass; call backward once per forward (or run "
        "extra passes inside no_sync()), or pass static_graph=True if activation checkpointing "
        "reuses it in one backward pass"
    )
