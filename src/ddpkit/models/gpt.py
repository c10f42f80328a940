"""A small decoder-only transformer in the GPT-2 style, for character-level language modeling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    The size defaults (0.42M parameters) are tuned for ``ddpkit train`` on the default
    corpus with two CPU processes of one thread each, at a global batch of 64 (lr 6e-3):
    wider or deeper models learned less per second of CPU. docs/commands.md has the step
    time and the loss curve measured.
    """

    vocab_size: int = 128
    """Number of distinct token ids; the tokenizer's ``vocab_size``."""

    block_size: int = 64
    """Longest context the model attends over; sets the position-embedding table size."""

    n_layer: int = 2
    """Number of transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int = 128
    """Width of the residual stream."""

    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""

    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"GPTConfig.{name} must be >= 1, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head}); pick an n_head that divides n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends only to positions <= t.

    Args:
        config: Model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One matmul for q, k and v beats three small ones on CPU.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over the sequence.

        Args:
            x: Residual stream of shape (B, T, C).

        Returns:
            Attention output of shape (B, T, C).
        """
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension for the attention kernel.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x hidden width.

    Args:
        config: Model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transform each position independently; (B, T, C) -> (B, T, C)."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    Args:
        config: Model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block; (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and tied input/output embeddings.

    Args:
        config: Model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tying saves vocab_size * n_embd parameters and helps small models; both modules
        # now hold the same Parameter, so DDP and optimizers see it once.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so the residual
        # stream's variance does not grow with depth (two residual adds per block).
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=proj_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Number of parameters, counting the tied embedding once."""
        # parameters() already yields a shared Parameter once.
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Predict the next token at every position.

        Args:
            idx: Token ids of shape (B, T) with T <= ``config.block_size``.

        Returns:
            Logits of shape (B, T, vocab_size).

        Raises:
            ConfigError: If T exceeds ``config.block_size``.
        """
        T = idx.size(1)
        if T > self.config.block_size:
            raise ConfigError(
                f"sequence length {T} exceeds block_size {self.config.block_size}; "
                f"crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend a batch of prompts by sampling one token at a time.

        Call ``model.eval()`` first if the model has dropout.

        Args:
            idx: Prompt token ids of shape (B, T); T may exceed ``block_size``, in
                which case only the last ``block_size`` tokens are attended to.
            max_new_tokens: Number of tokens to append.
            temperature: Divides the logits; lower is more conservative. Must be > 0.
            top_k: If given, sample only among the ``top_k`` most likely tokens.
            generator: Random source for sampling, for reproducible samples.

        Returns:
            Token ids of shape (B, T + max_new_tokens), starting with ``idx``.

        Raises:
            ConfigError: If ``temperature`` is not positive or ``top_k`` is below 1.
        """
        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ConfigError(f"top_k must be >= 1 or None, got {top_k}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits = self(context)[:, -1, :] / temperature  # (B, vocab_size)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
