"""Errors a user can cause, kept apart from bugs so the CLI can print them as one line."""


class ConfigError(ValueError):
    """A bad value from the user: the message names the value, what is required, and the fix.

    The ``ddpkit`` command prints it as one line and exits with code 2; library callers
    get an ordinary ``ValueError`` subclass.
    """
