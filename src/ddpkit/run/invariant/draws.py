"""Per-sample random draws of a step: the loop's own (``run.randn_like``) and the model's dropout.

Each micro-batch's rows get a key from (run seed, step, the row's place in the global batch)
when the step cycle hands the micro-batch over; every draw of that micro-batch is a hash of the
row's key, the draw's stream (the n-th ``run.randn_like`` of the micro-batch, or the n-th call
of a dropout module) and the element's place within the row (see ``keyed``). Row i's numbers
are then the same whichever rank, micro-batch or world size holds sample i, and after a resume.
"""

from __future__ import annotations

import torch

from ddpkit.errors import ConfigError
from ddpkit.run.invariant import keyed
from ddpkit.run.micro import Micro


class SampleDraws:
    """The keys of the micro-batch in hand, and the draws made from them.

    Args:
        seed: the run's seed.
        device: where the keys and the draws live.
        eager: build each micro-batch's keys as it is handed over (a model with keyed dropout,
            which may run compiled: a compiled graph must read the keys, not build them);
            otherwise at the loop's first draw.
    """

    def __init__(self, seed: int, device: torch.device, eager: bool = False) -> None:
        self.seed, self.device, self.eager = seed, device, eager
        self.step = self.offset = self.rows = 0
        self.keys: torch.Tensor | None = None  # (rows,) int32, the micro-batch's row keys
        self.calls: dict[object, int] = {}  # stream -> draws made from it in this micro-batch
        self.active = False
        self.positions = keyed.Positions()
        # Each set-up model's functional_dropout.ForwardDraws: the draws its forward makes by call.
        self.forwards: list = []

    def __deepcopy__(self, memo: dict) -> SampleDraws:
        return self  # an EMA's deepcopy of the model keeps drawing from the run's keys

    def enter(self, step: int, micro: Micro) -> None:
        """``micro`` of ``step`` is handed to the loop."""
        self.step, self.offset = step, micro.offset
        self.rows = len(micro.indices) or micro.samples
        self.calls, self.active, self.keys = {}, True, None
        if self.eager:
            self._build()

    def leave(self) -> None:
        """The step closed: draws outside a step are refused (the loop's) or plain (dropout)."""
        self.active, self.keys = False, None

    def _build(self) -> torch.Tensor:
        self.keys = keyed.row_keys(self.seed, self.step, self.offset, self.rows, self.device)
        return self.keys

    def stream(self, name: object) -> int:
        """The next stream of ``name`` in this micro-batch (its n-th call): a salt of its own."""
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        if isinstance(name, int):  # a module's salt: plain arithmetic, which a compiled graph folds
            return (name + n * keyed.GOLDEN + 2**31) % 2**32 - 2**31
        return keyed.salt(name, n)

    def bits(self, x: torch.Tensor, what: str, per_row: int | None = None) -> torch.Tensor:
        """(rows, numel / rows) hash bits for ``x``, whose dim 0 holds the micro-batch's rows."""
        if not self.active:
            raise ConfigError(
                f"run.{what} draws per sample of a step of run.loader's loop; outside one use torch.{what}"
            )
        if x.dim() == 0 or x.shape[0] != self.rows:
            raise ConfigError(
                f"run.{what}(x): x's first dimension must hold the micro-batch's {self.rows} samples; "
                f"got shape {tuple(x.shape)}"
            )
        keys = self.keys if self.keys is not None else self._build()
        n = x.numel() // self.rows if per_row is None else per_row
        return keyed.bits(keys, n, self.stream(("loop", what)), self.positions)

    def rand_like(self, x: torch.Tensor) -> torch.Tensor:
        """Uniform numbers in [0, 1) shaped like ``x``, row i drawn for sample i."""
        return keyed.uniform(self.bits(x, "rand_like"), _float(x)).reshape(x.shape)

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        """Standard normal numbers shaped like ``x``, row i drawn for sample i."""
        first, second = self.bits(x, "randn_like"), self.bits(x, "randn_like")
        return keyed.normal(first, second, _float(x)).reshape(x.shape)

    def randint(self, low: int, high: int, x: torch.Tensor) -> torch.Tensor:
        """(rows,) integers in [low, high), one per sample of ``x``."""
        if high <= low:
            raise ConfigError(f"run.randint: high={high} must be above low={low}")
        u = keyed.uniform(self.bits(x, "randint", per_row=1), torch.float64).reshape(-1)
        return (low + (u * (high - low)).floor()).to(torch.int64)

    def mask(self, module: int, x: torch.Tensor, p: float, per_row: int, batch_dim: int) -> torch.Tensor:
        """A keep mask of dropout probability ``p`` for ``x`` (dim ``batch_dim`` holds the rows), for
        the module whose salt is ``module``,
        scaled by 1 / (1 - p), with ``per_row`` draws a row (elements, channels, or 1 for a
        whole sample), shaped to broadcast against ``x`` moved to batch-first."""
        rows = self.rows
        batch = x.shape[batch_dim] if x.dim() > batch_dim else 0
        if batch == 0 or batch % rows:
            raise ConfigError(
                f"invariant_dropout: a dropout layer got shape {tuple(x.shape)}, whose dim {batch_dim} "
                f"does not hold the micro-batch's {rows} samples; set dropout_batch_dim= to the batch "
                "dimension"
            )
        hashed = keyed.bits(self.keys, per_row * (batch // rows), self.stream(module), self.positions)
        return keyed.keep_mask(hashed, p).to(x.dtype).mul_(1.0 / (1.0 - p))


def _float(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()
