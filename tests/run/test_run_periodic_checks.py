"""The periodic replica check, whose gather is read one step after it starts, still stops every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.launch.start_method import FORKSERVER


def _drift_on_rank1() -> None:
    run = ddpkit.Run(global_batch=4, check_every=2, progress=False)
    try:
        model = run.setup(nn.Linear(3, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(optimizer)
        data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
        for x, y in run.loader(data):
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
            if run.step == 3 and run.env.rank == 1:
                with torch.no_grad():  # what a rank-dependent bug would do
                    model.module.bias.add_(1.0)
    finally:
        run.close()


@pytest.mark.slow
def test_a_replica_that_drifts_stops_every_rank_at_the_next_check():
    with pytest.raises(ddpkit.LaunchError, match=r"replicas differ at step 4 \(model\): ranks \[1\].*'bias'"):
        ddpkit.launch(_drift_on_rank1, 2, start_method=FORKSERVER)
