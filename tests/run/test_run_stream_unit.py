"""A stream in a world of one, in the test process: what the step-time split says of its data."""

from __future__ import annotations

import json
import time

import pytest
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


def test_a_datasets_stream_with_a_shuffle_buffer_is_refused_at_the_loader_in_one_line():
    # datasets leaves the buffer out of state_dict and refills it on load: resumed after 10 of 100
    # samples with buffer_size=8, the stream read 86 of the other 90, in another order.
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": [[float(i)] for i in range(40)]})
    stream = table.to_iterable_dataset(num_shards=2).shuffle(seed=0, buffer_size=8).with_format("torch")
    run = ddpkit.Run(global_batch=4, progress=False)
    try:
        with pytest.raises(ddpkit.ConfigError, match=r"shuffle\(buffer_size=8\).*inexact_resume=True"):
            run.loader(stream)
    finally:
        run.finish()


def _shuffled_stream(out, capfd, kill_at: int | None = None) -> list[str]:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": [[float(i)] for i in range(40)]})
    stream = table.to_iterable_dataset(num_shards=2).shuffle(seed=0, buffer_size=8).with_format("torch")
    run = ddpkit.Run(out=out, global_batch=4, save_every=2, progress=False)
    model = run.setup(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(optimizer)
    for batch in run.loader(stream, inexact_resume=True):  # the user's choice, said out loud
        run.backward(model(batch["x"]).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if run.step == kill_at:
            run.close()
            break
    else:
        run.finish()
    return [line for line in capfd.readouterr().err.splitlines() if "ddpkit.run.data.stream" in line]


def test_with_inexact_resume_a_shuffled_stream_runs_and_its_resume_says_so_once(tmp_path, capfd):
    assert _shuffled_stream(tmp_path, capfd, kill_at=5) == []
    said = _shuffled_stream(tmp_path, capfd)
    assert len(said) == 1 and "(8 samples a rank) is not in its checkpoint" in said[0]
