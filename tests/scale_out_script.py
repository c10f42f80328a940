"""One ddpkit.Run loop for the scale-out tests, started by every launcher they try.

    python -m ddpkit run --nproc 2 scale_out_script.py OUT
    python scale_out_script.py OUT          # once per rank, with a launcher's variables set
    mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python scale_out_script.py OUT
    python scale_out_script.py OUT --ray RAY_DIR [--killed OUT2 --kill-at STEP]

Without ``--ray`` ``train_loop`` runs in this process and ddpkit.Run joins the process group
from whatever variables the launcher set (tests/dist/test_launcher_envs.py). With ``--ray``
this process is Ray's driver (tests/outside/test_ray_train.py): it starts a local Ray cluster of
its own (its session files under RAY_DIR), and a TorchTrainer runs the same ``train_loop`` into
OUT on 2 CPU workers, each of which Ray has already joined to a gloo process group (ddpkit.Run
keeps a group it did not create). With ``--killed OUT2`` a second TorchTrainer on the same
cluster trains into OUT2, and its rank 1 SIGKILLs itself when step ``--kill-at`` begins, on the
first attempt only (the file OUT2.killed says it happened); Ray's FailureConfig(max_failures=1)
starts both workers again, and ddpkit.Run's default resume="auto" continues from the newest
checkpoint in OUT2.

Every rank of every attempt appends ``{"rank", "pid", "first_step", "threads", "launcher"}`` to
OUT.attempts.jsonl, so a test can tell a restarted run from one that ran through, and see which
launcher ddpkit recognized.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS = 3  # of 10 steps of 32 samples
SAVE_EVERY = 4  # checkpoints at steps 4, 8, 12, ...: a kill at step 14 resumes mid-epoch 2


def make_dataset(n: int = 320, dim: int = 8, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)  # the same samples in every process
    x = torch.randn(n, dim, generator=g)  # (n, dim)
    teacher = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))  # learnable labels: the loss falls


def make_model(dim: int = 8, hidden: int = 32, classes: int = 3) -> torch.nn.Module:
    # Dropout draws from torch's generator: a resume is exact only if ddpkit restores it.
    return torch.nn.Sequential(
        torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, classes)
    )


def train_loop(config: dict) -> None:
    """The user's loop: the same function under every launcher."""
    torch.set_num_threads(1)  # float sums depend on the thread count: equal on every rank and run
    out, kill_at = Path(config["out"]), config.get("kill_at")
    marker = out.with_name(out.name + ".killed")
    run = ddpkit.Run(out=out, global_batch=32, save_every=SAVE_EVERY, log_every=1, progress=False)
    model = run.setup(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run.track(optimizer)
    loader = run.loader(make_dataset())
    first_step = None
    for _ in range(loader.epoch, EPOCHS):
        for x, y in loader:
            if first_step is None:
                first_step = run.step
                _record(out, run, first_step)
            if kill_at == run.step and run.env.rank == 1 and not marker.exists():
                marker.write_text(f"rank 1 (pid {os.getpid()}) killed itself at step {run.step}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            loss = F.cross_entropy(model(x), y)  # (B, classes) against (B,)
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
    run.finish()


def _record(out: Path, run: ddpkit.Run, first_step: int) -> None:
    env = run.env
    record = {
        "rank": env.rank, "local_rank": env.local_rank, "local_world_size": env.local_world_size,
        "launcher": env.launcher, "pid": os.getpid(), "first_step": first_step,
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    with open(out.with_name(out.name + ".attempts.jsonl"), "a") as f:  # one short line: atomic under O_APPEND
        f.write(json.dumps(record) + "\n")


def train_with_ray(ray_dir: Path, jobs: list[tuple[Path, int | None]]) -> None:
    """Train each (out, kill_at) job in its own TorchTrainer, side by side, on one local cluster."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def fit(out: Path, kill_at: int | None) -> None:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"out": str(out), "kill_at": kill_at},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                name=out.name,
                storage_path=str(ray_dir / "results"),
                failure_config=FailureConfig(max_failures=1),
            ),
        )
        trainer.fit()  # raises once the failures exceed max_failures

    # address="local": always a new cluster of this process's own, never one found on the machine.
    # 2 logical CPUs per job, so both worker groups start at once: most of a worker group's start
    # is Ray's waiting, not computing.
    ray.init(
        address="local",
        num_cpus=2 * len(jobs),
        include_dashboard=False,
        _temp_dir=str(ray_dir),
        object_store_memory=80 * 1024**2,
    )
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            for done in [pool.submit(fit, out, kill_at) for out, kill_at in jobs]:
                done.result()
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--ray", type=Path, help="run in a TorchTrainer; Ray's session files go here")
    parser.add_argument("--killed", type=Path, help="with --ray: a second run, into this folder, with a kill")
    parser.add_argument("--kill-at", type=int, default=14, help="the step at which --killed's rank 1 dies")
    args = parser.parse_args()
    if args.ray is None:
        train_loop({"out": str(args.out)})
        return
    jobs = [(args.out.resolve(), None)]
    if args.killed is not None:
        jobs.append((args.killed.resolve(), args.kill_at))
    train_with_ray(args.ray.resolve(), jobs)


if __name__ == "__main__":
    main()
