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
