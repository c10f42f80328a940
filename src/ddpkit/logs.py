"""Logging for worker processes: info from global rank 0 only, warnings and errors from every rank."""

from __future__ import annotations

import logging

from tqdm import tqdm

from ddpkit.dist import DistEnv


class _AboveBars(logging.StreamHandler):
    """Writes each line above the progress bars (tqdm.write) instead of into the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


def setup_logging(env: DistEnv) -> None:
    """Route ``ddpkit`` loggers to stderr, each line prefixed with the rank it comes from."""
    handler = _AboveBars()
    handler.setFormatter(logging.Formatter(f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("ddpkit")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if env.is_rank0 else logging.WARNING)
    logger.propagate = False
