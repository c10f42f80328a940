"""Logging for worker processes: info from global rank 0 only, warnings and errors from every rank."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from ddpkit.dist import DistEnv


class _AboveBars(logging.Handler):
    """Writes each line to stderr above the progress bar (tqdm.write), not into the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # sys.stderr as it is now: a script (or a test) may have replaced it since setup.
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
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
