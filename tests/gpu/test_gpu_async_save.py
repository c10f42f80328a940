"""``async_save=True`` on a GPU: the copies go through one DCP ``DefaultStager`` a run, into
pinned host memory that every later save refills, so a refill racing a write, or a copy read
before its device-to-host transfer landed, would change the checkpoint. The run with background
saves equals the synchronous one to the bit, and a kill inside the write resumes bit-equal; torch
and fsdp, a world of one on cuda:0 (tests/run/async_save_check.py; skipped without a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "run"))
from async_save_check import check_async_saves  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_async_saves_on_cuda_change_nothing_and_a_kill_in_the_write_resumes_bit_equal(tmp_path, engine):
    check_async_saves(tmp_path, engine, 1)
