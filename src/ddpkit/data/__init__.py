"""Datasets: a character-level text corpus, handwritten digits, synthetic regression data, and shards."""

from ddpkit.data.digits import load_digits, load_mnist
from ddpkit.data.shards import Shards
from ddpkit.data.synthetic import ToyDataset
from ddpkit.data.text import CharDataset, CharTokenizer, load_text

__all__ = ["CharDataset", "CharTokenizer", "Shards", "ToyDataset", "load_digits", "load_mnist", "load_text"]
