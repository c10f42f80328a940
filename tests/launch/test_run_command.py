"""`ddpkit run`: an unmodified torch DDP script runs under PyTorch's elastic agent, as under torchrun."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import textwrap

import pytest
from helpers import ddpkit_cli

from ddpkit.cli import main

PLAIN_DDP_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((8, 4), float(rank + 1))  # different data per rank
    model(x).pow(2).mean().backward()
    opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"world": world, "local_rank": int(os.environ["LOCAL_RANK"]), "params": flat.tolist()}, f)
    # torch 2.13 can abort at exit when a DDP model outlives its process group into interpreter
    # shutdown (gloo threads torn down late); freeing it first is good practice in any DDP script.
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    """
)

FAILING_SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise RuntimeError("rank one gives up")
        dist.barrier()

    main()
    """
)


def _ddpkit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return ddpkit_cli(
        [sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_plain_torch_ddp_script_runs_on_two_processes(tmp_path):
    script = tmp_path / "plain_ddp.py"
    script.write_text(PLAIN_DDP_SCRIPT)
    done = _ddpkit("run", "--nproc", "2", str(script), str(tmp_path))
    assert done.returncode == 0, done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert [r["local_rank"] for r in ranks] == [0, 1]
    # DDP averaged the gradients, so both replicas took the same step from different data.
    assert ranks[0]["params"] == ranks[1]["params"]


@pytest.mark.slow
def test_failing_worker_is_named_with_its_traceback(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING_SCRIPT)
    done = _ddpkit("run", "--nproc-per-node", "2", str(script))
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()
    report = "\n".join(last[-15:])
    assert "ddpkit: rank 1 failed (exit code 1)" in report
    assert "RuntimeError: rank one gives up" in report


def test_missing_script_is_one_line(capsys):
    assert main(["run", "--nproc", "2", "no_such_script.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ddpkit: error: script 'no_such_script.py' does not exist; give the path of a Python file"


@pytest.mark.parametrize(
    ("flag", "message"), [("0", "--nproc 0 is below 1"), ("many", "--nproc 'many' is not a number")]
)
def test_bad_nproc_is_one_line(capsys, tmp_path, flag, message):
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["run", "--nproc", flag, str(script)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_master_port_in_use_is_one_line(capsys, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["run", "--nproc", "1", "--master-port", str(port), str(script)]) == 2
    err = capsys.readouterr().err
    assert f"--master-port {port} is already in use" in err and len(err.strip().splitlines()) == 1


def _torchrun_parser_before_2_12(real):
    """torchrun's parser as torch 2.11 has it: no --shutdown-timeout (seen on a GPU machine)."""

    def parser():
        made = real()
        for action in [a for a in made._actions if a.dest == "shutdown_timeout"]:
            made._remove_action(action)
            for flag in action.option_strings:
                made._option_string_actions.pop(flag)
            for group in made._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
        return made

    return parser


@pytest.mark.parametrize("given", [[], ["--grace-period", "7"]])
def test_launch_flags_read_the_same_on_a_torchrun_without_shutdown_timeout(monkeypatch, tmp_path, given):
    # torch 2.11's torchrun has no --shutdown-timeout: `ddpkit run` died there with
    # AttributeError: 'Namespace' object has no attribute 'shutdown_timeout'.
    import torch.distributed.run as torchrun

    from ddpkit.launch.torchrun_flags import add_launch_flags, check_launch_args, run_parser, torchrun_argv

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for parser_of in (torchrun.get_args_parser, _torchrun_parser_before_2_12(torchrun.get_args_parser)):
        monkeypatch.setattr(torchrun, "get_args_parser", parser_of)
        ns = run_parser().parse_args(["--nproc", "1", *given, str(script)])
        check_launch_args(ns)
        default = parser_of().get_default("shutdown_timeout")
        assert ns.shutdown_timeout == (int(given[1]) if given else default)
        # `ddpkit train`'s route: its own flags, turned into torchrun's and read back.
        train = argparse.ArgumentParser()
        add_launch_flags(train)
        relaunch = run_parser().parse_args([*torchrun_argv(train.parse_args(given)), str(script)])
        assert relaunch.shutdown_timeout == (int(given[1]) if given else 30)
