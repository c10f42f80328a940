"""Diagnostics: replica fingerprints (desync), hang attribution, CPU oversubscription."""

from ddpkit.diagnostics.consistency import check_same_config
from ddpkit.diagnostics.fingerprint import check_replicas_agree, fingerprint
from ddpkit.diagnostics.hang import HANG_EXIT_CODE, HangWatchdog
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
