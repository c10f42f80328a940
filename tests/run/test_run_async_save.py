"""``async_save=True``: the same run as synchronous saves, to the bit, and a kill inside the
background write leaves nothing that loads: the same command resumes from the checkpoint before
and ends bit-equal, on the torch engine and on fsdp. The script is tests/run/async_save_script.py,
under `ddpkit run` on 2 processes; the check is tests/run/async_save_check.py."""

from __future__ import annotations

import pytest
from async_save_check import check_async_saves

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_async_saves_change_nothing_and_a_kill_in_the_write_resumes_bit_equal(tmp_path, engine):
    # torch: rank 0 writes state.pt in its thread. fsdp: every rank's thread writes its shards
    # through DCP's async_save, rank 0's commits the folder once all digests are in.
    check_async_saves(tmp_path, engine, 2)


def test_a_background_copy_is_done_before_a_forward_changes_running_statistics(tmp_path):
    # fsdp with BatchNorm: the shards' copy, slowed, must be over before the next forward updates
    # the running statistics it copies (not only before the optimizer step). On 2 processes each
    # rank's statistics differ after a forward, and DCP writes one rank's copy of a replicated
    # buffer: the save gives every rank rank 0's first, which the next forward would anyway.
    check_async_saves(tmp_path, "fsdp", 2, "--batchnorm")
