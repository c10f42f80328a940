"""Diagnostics: replica fingerprints (desync), hang attribution, CPU oversubscription.

The hang system is the package ``hang/``. ``HangWatchdog`` is imported on first use (PEP 562),
so that the launcher, which imports the hang monitor from ``hang/``, never loads the watchdog.
"""

from ddpkit.diagnostics.consistency import check_same_config
from ddpkit.diagnostics.exit_codes import HANG_EXIT_CODE
from ddpkit.diagnostics.fingerprint import check_replicas_agree, fingerprint
from ddpkit.dist.threads import oversubscription, warn_if_oversubscribed

__all__ = [
    "HANG_EXIT_CODE",
    "HangWatchdog",
    "check_replicas_agree",
    "check_same_config",
    "fingerprint",
    "oversubscription",
    "warn_if_oversubscribed",
]


def __getattr__(name: str) -> object:
    if name == "HangWatchdog":
        from ddpkit.diagnostics.hang.watchdog import HangWatchdog

        return HangWatchdog
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
