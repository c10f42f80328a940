"""``ddpkit.Run(bitwise=True)``: the same losses and weights to the bit on 1, 2 and 4 processes,
with keyed dropout, a ``count=`` token loss and gradient clipping, through a kill and a resume on
another world size; and the one-line refusals of what the mode cannot keep
(tests/run/bitwise_cases.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_cli, logged_losses, metric_lines, wait_unlocked

import ddpkit
from ddpkit.launch.failures import LaunchError
from ddpkit.launch.start_method import FORKSERVER
from ddpkit.run.invariant.bitwise import GrainSum, check_world, tree_all_reduce

sys.path.insert(0, str(Path(__file__).parent))
from bitwise_cases import refused, resumed_with, threads_changed, train, two_backwards  # noqa: E402

STEPS = 10


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # every bit: no tolerance


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bitwise")
    found = {}
    for world in (1, 2, 4):
        out = root / f"w{world}"
        ranks = ddpkit.launch(train, world, (str(out), STEPS), start_method=FORKSERVER)
        for other in ranks[1:]:
            _same_bits(other["weights"], ranks[0]["weights"])
        found[world] = {
            "weights": ranks[0]["weights"],
            "losses": logged_losses(out),
            "logged": [(line["acc"], line["tokens"]) for line in metric_lines(out) if "acc" in line],
            "threads": ranks[0]["threads"],
        }
    return found


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_same_losses_and_weights_to_the_bit_on_1_2_and_4_processes(runs, world):
    assert len(runs[1]["losses"]) == STEPS
    assert runs[world]["losses"] == runs[1]["losses"]  # floats compared exactly
    assert len(runs[1]["logged"]) == STEPS and runs[world]["logged"] == runs[1]["logged"]  # run.log's
    _same_bits(runs[world]["weights"], runs[1]["weights"])
    assert runs[world]["threads"] == runs[1]["threads"] == 1  # one intra-op thread a process


@pytest.mark.slow
def test_without_it_the_world_size_changes_the_bits(tmp_path):
    """The control: the same loop without the mode differs between 1 and 2 processes (within
    rounding), so the test above can fail."""
    a = ddpkit.launch(_plain, 1, (str(tmp_path / "a"),), start_method=FORKSERVER)[0]
    b = ddpkit.launch(_plain, 2, (str(tmp_path / "b"),), start_method=FORKSERVER)[0]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4)


def _plain(out: str) -> dict:
    return train(out, 6, bitwise=False)["weights"]


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [(2, 4), (4, 1)])
def test_a_kill_and_a_resume_on_another_world_size_is_bit_equal(runs, tmp_path, first, then):
    out = tmp_path / "run"
    with pytest.raises(LaunchError):  # every rank exits 17 as step 8 opens; the last checkpoint is step 6
        ddpkit.launch(train, first, (str(out), STEPS, "torch", 8), start_method=FORKSERVER)
    assert wait_unlocked(out)
    resumed = ddpkit.launch(train, then, (str(out), STEPS), start_method=FORKSERVER)[0]
    _same_bits(resumed["weights"], runs[1]["weights"])
    assert logged_losses(out)[-2:] == runs[1]["losses"][-2:]


@pytest.mark.slow
def test_a_summed_loss_keeps_the_bits_on_1_and_2_processes(tmp_path):
    found = [
        ddpkit.launch(
            train, world, (str(tmp_path / str(world)), 6, "torch", None, True, "sum"), start_method=FORKSERVER
        )
        for world in (1, 2)
    ]
    _same_bits(found[1][0]["weights"], found[0][0]["weights"])
    assert logged_losses(tmp_path / "2") == logged_losses(tmp_path / "1")


@pytest.mark.slow
def test_the_native_engine_keeps_the_bits(runs, tmp_path):
    ranks = ddpkit.launch(train, 2, (str(tmp_path / "native"), STEPS, "native"), start_method=FORKSERVER)
    _same_bits(ranks[0]["weights"], runs[1]["weights"])


def test_the_tree_over_ranks_adds_as_one_process_does():
    """tree_all_reduce on 4 ranks against one process adding the same 4 vectors ((0+1)+(2+3))."""
    from helpers import run_ranks

    found = run_ranks(_tree_rank, 4)
    parts = [_vector(rank) for rank in range(4)]
    expected = (parts[0] + parts[1]) + (parts[2] + parts[3])
    for got in found:
        assert torch.equal(got, expected)
    assert not torch.equal(((parts[0] + parts[1]) + parts[2]) + parts[3], expected)  # grouping matters


def _vector(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(1001, generator=gen) * 10 ** torch.randint(-4, 4, (1001,), generator=gen).float()


def _tree_rank(env) -> torch.Tensor:
    flat = _vector(env.rank)
    tree_all_reduce(flat)
    return flat


def test_the_grains_of_a_rank_add_as_a_binary_tree():
    params = [torch.nn.Parameter(torch.zeros(257))]
    grads = [torch.randn(257) * 10 ** torch.randint(-4, 4, (257,)).float() for _ in range(4)]
    tree = GrainSum()
    for grad in grads:
        params[0].grad = grad.clone()
        tree.add(params, object())
        assert params[0].grad is None
    tree.finish(params)
    assert torch.equal(params[0].grad, (grads[0] + grads[1]) + (grads[2] + grads[3]))


@pytest.mark.parametrize(
    ("grains", "world", "engine", "line"),
    [
        (8, 3, "torch", "gives the same bits on 1, 2, 4, 8 processes, and this run has 3"),
        (4, 8, "torch", "raise grains to a power of two at least 8"),
        (8, 2, "fsdp", "bitwise=True needs engine='torch' or 'native'"),
    ],
)
def test_a_world_or_engine_that_cannot_keep_the_tree_is_refused(grains, world, engine, line):
    with pytest.raises(ddpkit.ConfigError) as exc:
        check_world(grains, world, engine, None)
    assert line in str(exc.value)


@pytest.mark.parametrize(
    ("options", "loader", "stream", "line"),
    [
        ({"grains": 6}, None, False, "grains=6 must be a power of two"),
        ({"global_batch": 12}, None, False, "global_batch=12 does not divide by 8"),
        ({"global_batch": 16, "micro_batch": 4}, None, False, "leave micro_batch unset (it is 4)"),
        (
            {"global_batch": 16},
            None,
            False,
            "the epoch's last batch holds 4 of 16 samples; pass drop_last=True",
        ),
        ({"global_batch": 16}, None, True, "give run.loader a map-style dataset"),
        ({"global_batch": 16, "drop_last": True}, None, False, "run.all_gather gathers the ranks' shares"),
    ],
)
def test_what_the_mode_cannot_keep_is_one_line(options, loader, stream, line):
    assert line in refused(options, loader, stream)


def test_two_backwards_in_one_grain_are_one_line(tmp_path):
    with pytest.raises(ddpkit.ConfigError, match="bitwise=True adds each grain's gradient once"):
        two_backwards(str(tmp_path / "run"))


def test_a_resume_with_other_grains_is_refused(tmp_path):
    out = str(tmp_path / "run")
    ddpkit.launch(train, 1, (out, 3), start_method=FORKSERVER)
    assert "made with grains=8 and this run has grains=16" in resumed_with(out, 16)


@pytest.mark.slow
def test_ddpkit_train_gpt_is_the_same_bits_on_1_and_2_processes(tmp_path):
    """The default GPT of ``ddpkit train gpt``, through its flags (--bitwise --drop-last)."""
    for nproc in (1, 2):
        done = ddpkit_cli(
            [
                sys.executable,
                "-m",
                "ddpkit",
                "train",
                "gpt",
                "--bitwise",
                "--drop-last",
                "--nproc",
                str(nproc),
            ]
            + ["--steps", "5", "--log-every", "1", "--out", str(tmp_path / str(nproc))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    assert len(logged_losses(tmp_path / "1")) == 5
    assert logged_losses(tmp_path / "2") == logged_losses(tmp_path / "1")
    _same_bits(torch.load(tmp_path / "2" / "model.pt"), torch.load(tmp_path / "1" / "model.pt"))


def test_a_loop_that_sets_its_own_thread_count_is_told(tmp_path, capfd):
    threads = torch.get_num_threads()
    threads_changed(str(tmp_path / "run"))
    assert (
        "bitwise=True sets one intra-op thread a process on the CPU and this loop runs 2"
        in capfd.readouterr().err
    )
    assert torch.get_num_threads() == threads  # the run's close put the process's count back
