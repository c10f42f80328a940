"""Start-up check that every rank runs the same configuration and the same ddpkit.

Ranks started with different flags or different code (a stale install on one node) do not fail
at once: they train subtly different models, or hang in mismatched collectives much later.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from ddpkit.dist import DistEnv
from ddpkit.version import __version__


def check_same_config(config_json: str, env: DistEnv) -> None:
    """All ranks call this together; raises on every rank if any rank's config or version differs.

    Args:
        config_json: this rank's configuration, serialised deterministically.
        env: this process's distributed environment.
    """

    mine = hashlib.sha256(f"{__version__}\n{config_json}".encode()).hexdigest()[:16]
    everyone: list[str | None] = [None] * env.world_size
    dist.all_gather_object(everyone, (mine, __version__))
    reference = everyone[0]
    bad = [rank for rank, got in enumerate(everyone) if got != reference]
    if bad:
        raise RuntimeError(
            f"ranks {bad} run a different configuration or ddpkit version than rank 0 "
            f"(rank 0: {reference}, rank {bad[0]}: {everyone[bad[0]]}); start every node with the same "
            "flags and the same ddpkit install"
        )
