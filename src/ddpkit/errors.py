"""Errors a user can cause, kept apart from bugs so they end as one line, not a traceback.

Importing ddpkit makes an uncaught ``ConfigError`` one line in any script (``sys.excepthook``,
see ``ddpkit.launch.uncaught``): ``ddpkit: error: MESSAGE`` and exit code 2, from one rank.
"""

import argparse
import sys

USER_ERROR = 2  # the exit code of a process stopped by a ConfigError


class ConfigError(ValueError):
    """A bad value from the user: the message names the value, what is required, and the fix.

    The ``ddpkit`` command prints it as one line and exits with code 2, and so does a script
    that leaves it uncaught; library callers get an ordinary ``ValueError`` subclass.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (exit code 2), like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see {self.prog} --help")


def _one_line(previous):
    """An excepthook that hands every uncaught exception to ``ddpkit.launch.uncaught.report``."""

    def excepthook(kind, exc, tb):
        try:  # imported at the error, not here: this module must stay light for every process
            from ddpkit.launch.uncaught import report
        except Exception:
            return previous(kind, exc, tb)
        return report(kind, exc, tb, previous)

    excepthook.ddpkit_one_line = True
    return excepthook


if not getattr(sys.excepthook, "ddpkit_one_line", False):
    sys.excepthook = _one_line(sys.excepthook)
