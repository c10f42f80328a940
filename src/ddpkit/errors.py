"""Errors a user can cause, kept apart from bugs so the CLI can print them as one line."""

import argparse


class ConfigError(ValueError):
    """A bad value from the user: the message names the value, what is required, and the fix.

    The ``ddpkit`` command prints it as one line and exits with code 2; library callers
    get an ordinary ``ValueError`` subclass.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (exit code 2), like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see {self.prog} --help")
