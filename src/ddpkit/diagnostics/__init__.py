"""Diagnostics: replica fingerprints (desync), and later hang attribution and straggler timing."""

from ddpkit.diagnostics.consistency import check_same_config
from ddpkit.diagnostics.fingerprint import check_replicas_agree, fingerprint

__all__ = ["check_replicas_agree", "check_same_config", "fingerprint"]
