"""A model built without its weights gets them at run.setup (run/engine/materialize.py): from a file on
1, 2 and 3 processes on the torch and fsdp engines, equal to the eager build's; from its own
initialization, equal to an eager ``Net()`` under the run's seed; and one line for each misuse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.launch.start_method import FORKSERVER

sys.path.insert(0, str(Path(__file__).parent))
from meta_cases import Net, every_case  # noqa: E402


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=tol, atol=tol, msg=key)


@pytest.mark.slow
def test_meta_models_get_the_files_weights_and_train_alike_on_1_2_and_3_processes(tmp_path):
    torch.manual_seed(5)
    saved = {k: v.clone() for k, v in Net().state_dict().items()}
    torch.save(saved, tmp_path / "net.pt")
    runs = {
        n: ddpkit.launch(every_case, n, (str(tmp_path / "net.pt"),), start_method=FORKSERVER)[0]
        for n in (1, 2, 3)
    }
    reference = runs[1]["torch", "eager", "file"]
    for n, cases in runs.items():
        for (engine, build, source), result in cases.items():
            if source == "file":  # the file's tensors, to the bit, on every engine and world
                assert all(torch.equal(result["first"][k], v) for k, v in saved.items()), (n, engine, build)
                _close(result["last"], reference["last"], 1e-5)
            else:  # the run's own draws: an eager Net() under the run's seed, on any world
                eager = runs[1]["torch", "eager", "init"]["first"]
                assert all(torch.equal(result["first"][k], eager[k]) for k in eager), (n, engine, build)
                _close(result["last"], runs[1]["torch", "eager", "init"]["last"], 1e-5)


def _setup(net: nn.Module, **options) -> nn.Module:
    run = ddpkit.Run(progress=False)
    try:
        return run.setup(net, **options)
    finally:
        run.close()


def test_a_meta_buffer_no_state_dict_holds_is_one_line():
    with torch.device("meta"):
        net = Net()
    with pytest.raises(
        ConfigError, match=r"buffer 'scale' of Net was built on the meta device .*empty_init\(\)"
    ):
        _setup(net)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_a_parameter_nothing_initializes_is_one_line_and_init_fixes_it():
    with torch.device("meta"):
        net = NoReset()
    with pytest.raises(ConfigError, match=r"param 'w' of NoReset got no value.*init=fn"):
        _setup(net)
    with torch.device("meta"):
        net = NoReset()
    model = _setup(net, init=lambda m: nn.init.ones_(m.w) if isinstance(m, NoReset) else None)
    assert torch.equal(model.w, torch.ones(3, 2))


def test_weights_of_another_model_or_no_file_are_one_line(tmp_path):
    torch.save({"w": torch.zeros(2, 2)}, tmp_path / "other.pt")
    torch.save({"w": torch.zeros(3, 2), "v": torch.zeros(1)}, tmp_path / "more.pt")
    for weights, match in [
        (
            tmp_path / "other.pt",
            r"do not fit NoReset \(0 of this model's tensors missing, 0 unknown, 1 of another shape",
        ),
        (
            tmp_path / "more.pt",
            r"do not fit NoReset \(0 of this model's tensors missing, 1 unknown, 0 of another shape",
        ),
        (tmp_path / "absent.pt", r"weights='.*absent.pt' does not exist"),
        (tmp_path, r"is a folder without model.safetensors.index.json"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _setup(NoReset(), weights=weights)


@pytest.mark.parametrize("kind", ["torch", "safetensors"])
def test_a_weights_file_gives_a_shards_part_alone(tmp_path, kind):
    """``weights=`` on fsdp copies each rank's rows of a tensor (``WeightsSource.get_part``): from a
    ``torch.save`` file through its mapping, from safetensors through ``get_slice``."""
    from ddpkit.run.engine.weights_source import WeightsSource

    state = {"w": torch.arange(60.0).reshape(6, 10), "b": torch.arange(6.0)}
    path = tmp_path / ("w.pt" if kind == "torch" else "w.safetensors")
    if kind == "torch":
        torch.save(state, path)
    else:
        from safetensors.torch import save_file

        save_file(state, str(path))
    source = WeightsSource(path)
    assert torch.equal(source.get_part("w", (slice(2, 4), slice(0, 10))), state["w"][2:4])
    assert torch.equal(source.get_part("w", (slice(0, 6), slice(5, 7))), state["w"][:, 5:7])
    assert torch.equal(source.get_part("b", (slice(3, 6),)), state["b"][3:])
