"""Models used by the examples, tests and benchmarks: ToyModel, ConvNet and GPT."""

from ddpkit.models.convnet import ConvNet
from ddpkit.models.gpt import GPT, GPTConfig
from ddpkit.models.toy import ToyModel

__all__ = ["GPT", "ConvNet", "GPTConfig", "ToyModel"]
