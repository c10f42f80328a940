"""Every timing of the hang system, in one place: how often its collectors look, how long they wait
for each other, and how long a store call may take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HangTimings:
    """The hang system's timings; ``TIMINGS`` holds the ones in force.

    The collective timeout itself (``--collective-timeout``, ``collective_timeout``) and the
    desync and start-up timeouts are the user's settings, passed to the collectors; their
    defaults are here.
    """

    poll_s: float = 1.0
    """How often a watchdog thread, the launcher's monitor and a worker's progress thread look."""

    store_timeout_s: float = 5.0
    """How long one store call of a hang collector may take before it counts as failed."""

    answer_margin_s: float = 2.0
    """A watchdog waits for answers two of its polls and this much: answers come at each rank's next poll."""

    follow_s: float = 10.0
    """How long a rank that answered a report waits for its launcher to stop it before it exits itself."""

    desync_s: float = 30.0
    """Default of how long every rank may wait in different collectives before a desync is reported."""

    desync_check_share: float = 0.1
    """A rank blocked in a collective compares records every this share of ``desync_s`` (at least a poll)."""

    launcher_answer_s: float = 6.0
    """How long node 0's monitor waits for the other nodes' stacks."""

    ack_s: float = 10.0
    """How long node 0 keeps its store up for the other nodes to read a verdict."""

    quiet_s: float = 10.0
    """After a failed store call, how long the launcher's monitor waits before the next."""

    stale_s: float = 15.0
    """A launcher silent this long has lost its node, or the network to it."""

    dump_wait_s: float = 3.0
    """How long the launcher waits for a worker's faulthandler dump of its stacks."""

    dump_settle_s: float = 0.05
    """A dump is complete once it grew nothing in this long (faulthandler writes in small pieces)."""

    recheck_s: float = 0.1
    """How often a collector that waits for answers or dumps looks again."""

    ack_recheck_s: float = 0.2
    """How often node 0's monitor looks for the other nodes' acknowledgements."""

    auto_share: float = 0.9
    """Without ``--collective-timeout``: this share of the script's own process-group timeout, so
    the report comes before torch's timeout error and nothing torch would let wait is ended."""

    torch_default_timeout_s: float = 1800.0
    """gloo's process-group timeout, taken when a rank's own could not be read."""


TIMINGS = HangTimings()
