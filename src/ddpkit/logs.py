"""Logging for worker processes: info from global rank 0 only, warnings and errors from every rank.

The one place to make ddpkit quieter or louder: ``DDPKIT_LOG_LEVEL`` (``--log-level`` of ``ddpkit
run`` and ``ddpkit train`` sets it for the workers): ``debug`` adds every checkpoint's line and
the other ranks' debug lines, ``info`` is the default, ``warning`` keeps warnings and errors
only, ``error`` errors only. What ddpkit prints itself (a resume, a restart, a failure) is
not a log line and stays.
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


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
    level = log_level(os.environ.get("DDPKIT_LOG_LEVEL", "info"))
    # Info is rank 0's (every rank would say the same); debug is every rank's.
    logger.setLevel(level if env.is_rank0 or level == logging.DEBUG else max(level, logging.WARNING))
    logger.propagate = False


def log_level(name: str) -> int:
    """``debug``, ``info``, ``warning`` or ``error`` as a logging level; one line for another word."""
    if name.lower() not in LEVELS:
        raise ConfigError(
            f"log level {name!r} is not one of {', '.join(LEVELS)}; for example --log-level warning"
        )
    return LEVELS[name.lower()]
