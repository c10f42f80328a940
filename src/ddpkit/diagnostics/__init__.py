"""Diagnostics: replica fingerprints (desync), and later hang attribution and straggler timing."""

from ddpkit.diagnostics.fingerprint import check_replicas_agree, fingerprint

__all__ = ["check_replicas_agree", "fingerprint"]
