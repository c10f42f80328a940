"""The small convolutional classifier of PyTorch's MNIST data-parallel example."""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.errors import ConfigError


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    # padding=2 keeps the 5x5 conv size-preserving, so only the pool halves H and W.
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=5, padding=2),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class ConvNet(nn.Module):
    """Two conv/BatchNorm/ReLU/max-pool blocks and a linear classifier.

    BatchNorm makes this the model that shows why DDP broadcasts buffers: running
    statistics are not gradients, so they are not averaged by the all-reduce.

    Args:
        num_classes: Number of output classes.
        image_size: Height and width of the square single-channel input; must be a
            positive multiple of 4 (28 for MNIST, 8 for scikit-learn's digits).

    Raises:
        ConfigError: If ``num_classes`` is not positive or ``image_size`` is not a
            positive multiple of 4.
    """

    def __init__(self, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        if num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
        if image_size < 4 or image_size % 4 != 0:
            raise ConfigError(
                f"image_size must be a positive multiple of 4 (two 2x2 poolings), got "
                f"{image_size}; use 28 for MNIST or 8 for scikit-learn digits"
            )
        self.image_size = image_size
        self.layer1 = _conv_block(1, 16)
        self.layer2 = _conv_block(16, 32)
        self.fc = nn.Linear((image_size // 4) ** 2 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Classify a batch of images.

        Args:
            x: Images of shape (B, 1, image_size, image_size).

        Returns:
            Logits of shape (B, num_classes).
        """
        out = self.layer2(self.layer1(x))  # (B, 32, S/4, S/4)
        return self.fc(out.flatten(1))
