"""Character-level text corpus: loading, tokenizing and slicing into training examples."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from ddpkit.errors import ConfigError


def _default_corpus() -> str:
    # CPython ships its own documentation topics as a module, so there is always an
    # English corpus (~465K characters) available without a download.
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def load_text(path: str | None, block_size: int = 1) -> str:
    """Read a training corpus.

    Args:
        path: A UTF-8 text file, or None for the default corpus: the English
            documentation topics that ship with CPython (``pydoc_data.topics``).
        block_size: Example length the corpus must cover; it needs at least
            ``block_size + 1`` characters for one (input, target) pair.

    Returns:
        The corpus as one string.

    Raises:
        ConfigError: If the file does not exist, is not UTF-8, or is too short.
    """
    if path is None:
        return _default_corpus()
    if not os.path.isfile(path):
        problem = "is not a file" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"text file {path!r} {problem}; pass an existing UTF-8 text file to --data")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"text file {path!r} is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
            f"pass a UTF-8 text file to --data"
        ) from None
    if len(text) <= block_size:
        raise ConfigError(
            f"text file {path!r} has {len(text)} characters, but block_size {block_size} "
            f"needs at least {block_size + 1}; pass a longer text file to --data"
        )
    return text


class CharTokenizer:
    """Maps each distinct character of a text to an integer id, in sorted order.

    Args:
        text: The text whose characters form the vocabulary.

    Raises:
        ConfigError: If ``text`` is empty.
    """

    def __init__(self, text: str) -> None:
        if not text:
            raise ConfigError("cannot build a CharTokenizer from empty text; pass the corpus")
        self.chars = sorted(set(text))
        self._stoi = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Turn a string into ids.

        Args:
            text: Characters that all occur in the tokenizer's vocabulary.

        Returns:
            LongTensor of shape (len(text),).

        Raises:
            ConfigError: If ``text`` holds a character outside the vocabulary.
        """
        try:
            ids = [self._stoi[ch] for ch in text]
        except KeyError as exc:
            raise ConfigError(
                f"character {exc.args[0]!r} is not in the tokenizer's vocabulary of "
                f"{self.vocab_size} characters; use only characters from the corpus"
            ) from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Turn ids back into a string.

        Args:
            ids: A list of ids or a 1-D tensor of ids.

        Returns:
            The decoded string.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


class CharDataset(Dataset):
    """Every window of ``block_size`` tokens, paired with the same window shifted by one.

    Item i is ``(data[i : i + block_size], data[i + 1 : i + block_size + 1])``, so each
    position's target is the next token.

    Args:
        data: Token ids of shape (N,).
        block_size: Length of each example.

    Raises:
        ConfigError: If ``data`` is not 1-D or holds no more than ``block_size`` tokens.
    """

    draws_random = False  # its samples are fixed: run.loader need not seed them

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if data.dim() != 1:
            raise ConfigError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
        if len(data) <= block_size:
            raise ConfigError(
                f"the corpus has {len(data)} tokens but block_size {block_size} needs at least "
                f"{block_size + 1}; use a longer text or a smaller block_size"
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for CharDataset of length {len(self)}")
        chunk = self.data[i : i + self.block_size + 1]  # (block_size + 1,)
        return chunk[:-1], chunk[1:]
