"""The exit codes ddpkit's own processes end with, in a module that imports nothing.

Launchers (``ddpkit.launch``) and the watchdog (``diagnostics/hang/watchdog.py``) both read them from here,
so a launcher need not import the watchdog. A script may exit with any code, so no launcher takes
one of these as evidence by itself: a hang is named from the launcher's own monitor (its verdict,
or the key a rank's watchdog sets in the workers' store), a stop from the signal it received.
"""

HANG_EXIT_CODE = 3  # a rank whose HangWatchdog reported a hang, or followed the rank that did
SIGNAL_EXIT_BASE = 128  # + the signal: a launcher or rank stopped by it, as a shell reports one


def exit_code_for_signal(signum: int) -> int:
    """The exit code of a process that stopped because of signal ``signum`` (143 for SIGTERM)."""
    return SIGNAL_EXIT_BASE + signum
