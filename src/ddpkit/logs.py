"""Logging for worker processes: info from global rank 0 only, warnings and errors from every rank."""

from __future__ import annotations

import logging

from ddpkit.dist import DistEnv


def setup_logging(env: DistEnv) -> None:
    """Route ``ddpkit`` loggers to stderr, each line prefixed with the rank it comes from."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("ddpkit")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if env.is_rank0 else logging.WARNING)
    logger.propagate = False
