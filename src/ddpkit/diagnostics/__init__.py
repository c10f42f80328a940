"""Diagnostics: replica fingerprints (desync), hang attribution, and later straggler timing."""

from ddpkit.diagnostics.consistency import check_same_config
from ddpkit.diagnostics.fingerprint import check_replicas_agree, fingerprint
from ddpkit.diagnostics.hang import HANG_EXIT_CODE, HangWatchdog

__all__ = ["HANG_EXIT_CODE", "HangWatchdog", "check_replicas_agree", "check_same_config", "fingerprint"]
