"""A stream in a world of one, in the test process: what the step-time split says of its data."""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

import ddpkit

SLEEP_S = 0.02  # per sample: reading a stream's sample takes this long


class _SlowStream(IterableDataset):
    def __iter__(self):
        for i in range(40):
            time.sleep(SLEEP_S)
            yield torch.tensor([float(i)]), torch.tensor([1.0])


def test_a_streams_reading_time_is_reported_as_data_not_compute(tmp_path):
    # The stream's loop driver once skipped the data timer: its reading time showed as compute.
    run = ddpkit.Run(out=tmp_path, global_batch=4, micro_batch=2, steps=6, log_every=1, progress=False)
    model = run.setup(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(optimizer)
    for x, y in run.loader(_SlowStream()):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
    run.finish()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ranks = [line["ranks"][0] for line in lines if "ranks" in line]
    data, compute = sum(r["data_s"] for r in ranks), sum(r["compute_s"] for r in ranks)
    slept = 6 * 4 * SLEEP_S  # six steps of four samples
    assert data >= 0.8 * slept, (data, compute, slept)
    assert compute < data, (data, compute)
