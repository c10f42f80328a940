"""Activation checkpointing (``checkpoint_modules``) changes nothing but memory: a GPT whose blocks
drop out gives the same losses to the bit with and without it, on the torch and fsdp engines, with
torch's dropout and with keyed dropout, on 2 processes with micro-batches (tests/run/recompute_cases.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.launch.start_method import FORKSERVER

sys.path.insert(0, str(Path(__file__).parent))
from recompute_cases import every_case  # noqa: E402


@pytest.mark.slow
def test_checkpointed_blocks_give_the_same_losses_to_the_bit():
    runs = ddpkit.launch(every_case, 2, start_method=FORKSERVER)
    for rank, cases in enumerate(runs):
        for engine in ("torch", "fsdp"):
            for keyed in (False, True):
                plain, recomputed = cases[engine, keyed, False], cases[engine, keyed, True]
                assert len(plain) == 8  # 4 steps of 2 micro-batches on each rank
                assert recomputed == plain, (rank, engine, keyed)


def test_checkpoint_modules_naming_no_class_of_the_model_is_one_line():
    run = ddpkit.Run(checkpoint_modules=["Blok"], progress=False)
    try:
        with pytest.raises(
            ConfigError, match=r"checkpoint_modules=\['Blok'\] matches no module of Sequential"
        ):
            run.setup(nn.Sequential(nn.Linear(2, 2)))
    finally:
        run.close()
    with pytest.raises(ConfigError, match="offload=True .* needs engine='fsdp', not 'torch'"):
        ddpkit.Run(offload=True)
