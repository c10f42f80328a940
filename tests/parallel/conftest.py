"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

import ddpkit


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in the test process, destroyed afterwards."""
    env = ddpkit.init_distributed("gloo")
    try:
        yield env
    finally:
        ddpkit.destroy()
