"""Datasets: a character-level text corpus, handwritten digits, and synthetic regression data."""

from ddpkit.data.digits import load_digits, load_mnist
from ddpkit.data.synthetic import ToyDataset
from ddpkit.data.text import CharDataset, CharTokenizer, load_text

__all__ = ["CharDataset", "CharTokenizer", "ToyDataset", "load_digits", "load_mnist", "load_text"]
