"""``ddpkit bench dropout``: what invariant dropout's per-sample masks cost against nn.Dropout.

Two measurements in one process, each with the plain and the keyed variant side by side:

- a dropout layer alone, forward and backward on one (batch, features) input: ``nn.Dropout``
  against the same module swapped by ``run.dropout.key_dropout`` (whose training forward
  multiplies by ``SampleDraws.mask``), eager, and both under ``torch.compile`` (inductor; the
  compiled keyed layer is held to the compiled nn.Dropout);
- a training step (forward, backward, AdamW) of ddpkit's GPT with dropout, plain against keyed
  (its nn.Dropout modules swapped, and its attention's ``dropout_p`` keyed by
  ``run.functional_dropout.ForwardDraws``, which runs attention in torch's math form), eager and
  compiled (where the functional calls are not keyed).

The keyed variants enter the micro-batch (``SampleDraws.enter``, which builds the row keys) in
every timed call, as the step cycle does once per micro-batch. The variants take turns in
rounds, and which goes first flips every round; each ratio keyed / plain is the median of the
rounds' ratios with a 90% bootstrap interval, so load that drifts between rounds on a shared
machine cancels out. Warm-up calls (compilation included) come before the first round.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.bench.engine_summary import interval90
from ddpkit.errors import OneLineParser
from ddpkit.models import GPT, GPTConfig
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.invariant.dropout import key_dropout
from ddpkit.run.invariant.functional_dropout import ForwardDraws
from ddpkit.run.micro import Micro

LAYER_TARGET = 1.2  # the goal: a keyed layer at most 1.2x a dropout layer
STEP_TARGET = 1.02  # the goal: at most 2% of a GPT step with dropout 0.1


def whole_batch(batch: int) -> Micro:
    """One micro-batch holding a whole step's ``batch`` samples, as one process without micro_batch."""
    return Micro(list(range(batch)), 1.0, batch, True, True, batch, 0)


def _variants(plain: nn.Module, keyed: nn.Module, compiled: bool) -> dict[str, nn.Module]:
    found = {"plain": plain, "keyed": keyed}
    if compiled:  # inductor; the compiled module shares its parameters with the eager one
        found |= {"plain compiled": torch.compile(plain), "keyed compiled": torch.compile(keyed)}
    return found


class LayerCase:
    """One dropout layer, plain and keyed, forward and backward on one (batch, features) input.

    Args:
        batch: samples of the input (the micro-batch's rows).
        features: elements per sample.
        p: the dropout probability.
        device: where the input and the masks live.
        compiled: also time both layers under ``torch.compile``.
    """

    def __init__(self, batch: int, features: int, p: float, device: torch.device, compiled: bool) -> None:
        self.draws, self.micro, self.step = SampleDraws(0, device, eager=True), whole_batch(batch), 0
        self.x = torch.randn(batch, features, device=device, requires_grad=True)  # (B, F)
        self.grad = torch.randn_like(self.x)  # what the layer above would send back
        keyed = nn.Dropout(p)
        key_dropout(keyed, self.draws, 0)
        self.modules = _variants(nn.Dropout(p), keyed, compiled)

    def run(self, name: str) -> torch.Tensor:
        """One forward and backward of variant ``name`` on a new step's keys; its output."""
        self.step += 1
        if name.startswith("keyed"):
            self.draws.enter(self.step, self.micro)
        out = self.modules[name](self.x)
        # autograd.grad, not backward: nothing accumulates into x.grad from call to call.
        torch.autograd.grad(out, self.x, self.grad)
        return out


class GPTCase:
    """ddpkit's GPT with dropout, as two copies (plain and keyed), each with its own AdamW.

    Args:
        cfg: the GPT's shape and dropout.
        batch: sequences per step.
        device: where the models and the data live.
        compiled: also time both models under ``torch.compile`` (the optimizer step stays eager).
    """

    def __init__(self, cfg: GPTConfig, batch: int, device: torch.device, compiled: bool) -> None:
        torch.manual_seed(0)
        plain = GPT(cfg).to(device)
        keyed = copy.deepcopy(plain)
        self.draws, self.micro, self.step = SampleDraws(0, device, eager=True), whole_batch(batch), 0
        self.keyed_modules = key_dropout(keyed, self.draws, 0)
        ForwardDraws(keyed, self.draws, 0, keyed=True)  # the attention's dropout_p, as run.setup keys it
        self.optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, keyed)}
        self.modules = _variants(plain, keyed, compiled)
        self.owner = {"plain": plain, "keyed": keyed, "plain compiled": plain, "keyed compiled": keyed}
        self.tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), device=device)

    def run(self, name: str) -> torch.Tensor:
        """One training step of variant ``name``; its loss."""
        self.step += 1
        keyed = name.startswith("keyed")
        if keyed:
            self.draws.enter(self.step, self.micro)
        optimizer = self.optimizers[self.owner[name]]
        optimizer.zero_grad(set_to_none=True)
        logits = self.modules[name](self.tokens[:, :-1])  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        if keyed:
            self.draws.leave()  # the step closed, as the step cycle says
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time them, not their launches
        torch.cuda.synchronize(device)


def timed_rounds(
    run: Callable[[str], object],
    names: list[str],
    rounds: int,
    per_round: int,
    warmup: int,
    device: torch.device,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per variant, the seconds per call of each round; and the seconds its warm-up calls took
    (compilation included), which come first and are not in the rounds."""
    warm = {}
    for name in names:
        start = time.perf_counter()
        for _ in range(warmup):
            run(name)
        _sync(device)
        warm[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        # Which variant goes first flips every round: whatever the one before left (caches,
        # allocator state, the other engineer's load) falls on each alike.
        for name in names if r % 2 == 0 else names[::-1]:
            _sync(device)
            start = time.perf_counter()
            for _ in range(per_round):
                run(name)
            _sync(device)
            times[name].append((time.perf_counter() - start) / per_round)
    return times, warm


def pairs(times: dict[str, list[float]], warm: dict[str, float]) -> dict[str, dict]:
    """Per mode (eager, compiled): each variant's median ms, the keyed / plain ratio, the warm-ups."""
    found = {}
    for mode, suffix in (("eager", ""), ("compiled", " compiled")):
        if "plain" + suffix not in times:
            continue
        plain, keyed = times["plain" + suffix], times["keyed" + suffix]
        ratios = [k / p for k, p in zip(keyed, plain, strict=True)]
        found[mode] = {
            "plain_ms": 1e3 * statistics.median(plain),
            "keyed_ms": 1e3 * statistics.median(keyed),
            "ratio": statistics.median(ratios),
            "interval90": interval90(ratios),
            "warmup_s": warm["plain" + suffix] + warm["keyed" + suffix],
        }
    return found


def parser() -> OneLineParser:
    """The ``ddpkit bench dropout`` command line."""
    p = OneLineParser(prog="ddpkit bench dropout", description=__doc__.split("\n\n")[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default, help=f"where to run (default {default})")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (default 0: torch's default)")
    p.add_argument("--p", type=float, default=0.1, help="dropout probability (default 0.1)")
    p.add_argument("--batch", type=int, default=64, help="layer: samples (default 64)")
    features = "layer: elements per sample (default 98304, a 256 x 384 activation)"
    p.add_argument("--features", type=int, default=256 * 384, help=features)
    p.add_argument("--gpt-batch", type=int, default=16, help="GPT: sequences per step (default 16)")
    p.add_argument("--block-size", type=int, default=64, help="GPT: tokens per sequence (default 64)")
    p.add_argument("--n-layer", type=int, default=2, help="GPT: blocks (default 2)")
    p.add_argument("--n-embd", type=int, default=128, help="GPT: width (default 128)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--per-round", type=int, default=2, help="calls per variant per round (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per variant first (default 3)")
    p.add_argument("--no-compile", action="store_true", help="eager only: skip torch.compile")
    p.add_argument("--no-gpt", action="store_true", help="time the layer only")
    p.add_argument("--json", type=Path, help="write the results to this file")
    return p


def measure(ns: argparse.Namespace) -> dict:
    """Both measurements the parsed flags ``ns`` describe: their pairs and their shapes."""
    device, compiled = torch.device(ns.device), not ns.no_compile
    rounds = (ns.rounds, ns.per_round, ns.warmup, device)
    layer = LayerCase(ns.batch, ns.features, ns.p, device, compiled)
    result = {"layer": pairs(*timed_rounds(layer.run, list(layer.modules), *rounds))}
    if not ns.no_gpt:
        cfg = GPTConfig(block_size=ns.block_size, n_layer=ns.n_layer, n_embd=ns.n_embd, dropout=ns.p)
        gpt = GPTCase(cfg, ns.gpt_batch, device, compiled)
        result["gpt"] = pairs(*timed_rounds(gpt.run, list(gpt.modules), *rounds))
        result["gpt_keyed_modules"] = gpt.keyed_modules
        result["gpt_params"] = sum(p.numel() for p in gpt.owner["plain"].parameters())
    return result


def _line(mode: str, row: dict, plain: str, target: float, percent: bool) -> str:
    low, high = row["interval90"]
    text = (
        f"  {mode:<9} {plain} {row['plain_ms']:9.3f} ms   keyed {row['keyed_ms']:9.3f} ms   "
        f"keyed / plain {row['ratio']:.3f} [{low:.3f}, {high:.3f}]"
    )
    if percent:
        text += f"   overhead {100 * (row['ratio'] - 1):+.1f}%"
    verdict = "met" if row["ratio"] <= target else "missed"
    return text + f"   target <= {target:g}: {verdict}   (warm-up {row['warmup_s']:.1f} s, untimed)"


def report(ns: argparse.Namespace, result: dict) -> str:
    """The printed summary of ``measure``'s result."""
    threads = "" if ns.device != "cpu" else f", intra-op threads {torch.get_num_threads()}"
    lines = [
        f"# ddpkit bench dropout: p={ns.p:g} on {ns.device}{threads}; {ns.rounds} rounds x "
        f"{ns.per_round} calls per variant, alternating; ratios: median of per-round ratios [90% interval]",
        f"dropout layer {ns.batch} x {ns.features}, forward + backward:",
    ]
    lines += [_line(m, row, "nn.Dropout", LAYER_TARGET, False) for m, row in result["layer"].items()]
    if "gpt" in result:
        lines.append(
            f"GPT step ({result['gpt_params'] / 1e6:.2f}M params, n_layer={ns.n_layer}, n_embd={ns.n_embd}, "
            f"batch {ns.gpt_batch} x {ns.block_size}, AdamW), {result['gpt_keyed_modules']} nn.Dropout keyed:"
        )
        lines += [_line(m, row, "plain", STEP_TARGET, True) for m, row in result["gpt"].items()]
        lines.append(
            f"note: keyed, the GPT's scaled_dot_product_attention(dropout_p={ns.p:g}) runs in torch's "
            "math form with a keyed mask (eager); compiled, it keeps the process's own draws"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``ddpkit bench dropout``: prints both measurements (and writes --json); 0 on success."""
    ns = parser().parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    # AdamW's second moments on a small model decay into denormal floats, whose arithmetic is
    # ~100x slower on x86 CPUs and drifts over the run (as in ``bench trainer``).
    torch.set_flush_denormal(True)
    try:
        result = measure(ns)
    finally:
        torch.set_flush_denormal(False)  # torch's default: leave the process as it was
    print(report(ns, result))
    if ns.json:
        about = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()}
        result |= {"config": about, "torch": torch.__version__}
        ns.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
