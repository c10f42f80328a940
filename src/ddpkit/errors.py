"""Errors a user can cause, kept apart from bugs so they end as one line, not a traceback.

A leaf: it imports nothing of ddpkit, and importing it changes nothing in the process. Where a
run or a launcher starts (``ddpkit.Run``, the ``ddpkit`` command, ``ddpkit.launch``), it installs
``ddpkit.launch.uncaught.install_excepthook``, which makes an uncaught ``ConfigError`` one line:
``ddpkit: error: MESSAGE`` and exit code 2, from one rank.
"""

import argparse

USER_ERROR = 2  # the exit code of a process stopped by a ConfigError


class ConfigError(ValueError):
    """A bad value from the user: the message names the value, what is required, and the fix.

    The ``ddpkit`` command prints it as one line and exits with code 2, and so does a script
    that leaves it uncaught after a ``ddpkit.Run`` started (``install_excepthook``); library
    callers get an ordinary ``ValueError`` subclass.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (exit code 2), like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see {self.prog} --help")
