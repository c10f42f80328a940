"""Handwritten-digit datasets: MNIST from local IDX files, and scikit-learn's bundled 8x8 digits.

Neither ever downloads: MNIST must already be on disk, and the scikit-learn digits ship
inside the scikit-learn package.
"""

from __future__ import annotations

import gzip
import os

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ddpkit.errors import ConfigError

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
IMAGES_FILE = "train-images-idx3-ubyte"
LABELS_FILE = "train-labels-idx1-ubyte"
# IDX magic numbers: two zero bytes, dtype 0x08 (unsigned byte), then the number of dims.
_IMAGES_MAGIC = 0x00000803
_LABELS_MAGIC = 0x00000801


def read_idx(path: str, magic: int) -> np.ndarray:
    """Read one IDX file of unsigned bytes, gzip-compressed if its name ends in ``.gz``.

    Args:
        path: The IDX file.
        magic: The expected magic number (2051 for images, 2049 for labels).

    Returns:
        A uint8 array shaped by the dimensions in the file's header.

    Raises:
        ConfigError: If the magic number is wrong or the file is shorter than its
            header says.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    found = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if found != magic:
        shown = "none (file shorter than 4 bytes)" if found is None else f"{found:#010x}"
        raise ConfigError(
            f"{path!r} is not an IDX file of the expected kind: magic number {shown}, "
            f"expected {magic:#010x}; check that the MNIST files are not swapped or corrupt"
        )
    ndim = raw[3]
    # Each dimension is a big-endian uint32 after the 4-byte magic.
    dims = tuple(np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).tolist())
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - offset != expected:
        raise ConfigError(
            f"{path!r} header promises {expected} bytes of data for shape {dims}, but the "
            f"file holds {len(raw) - offset}; the file is truncated or corrupt, fetch it again"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)


def _find(directory: str, name: str) -> str | None:
    # torchvision keeps the raw files under MNIST/raw, so look there too.
    for folder in (directory, os.path.join(directory, "MNIST", "raw")):
        for candidate in (name, name + ".gz"):
            path = os.path.join(folder, candidate)
            if os.path.isfile(path):
                return path
    return None


def _find_or_raise(directory: str, name: str) -> str:
    path = _find(directory, name)
    if path is None:
        raise ConfigError(
            f"MNIST file {name!r} (or {name}.gz) not found in {directory!r}; put "
            f"{IMAGES_FILE} and {LABELS_FILE} (optionally .gz) there, or use the "
            f"scikit-learn digits, which need no files"
        )
    return path


def load_mnist(directory: str) -> TensorDataset:
    """Load the MNIST training set from local IDX files.

    Args:
        directory: Folder holding ``train-images-idx3-ubyte`` and
            ``train-labels-idx1-ubyte``, each optionally gzip-compressed with a
            ``.gz`` suffix (a torchvision ``MNIST/raw`` subfolder also works).

    Returns:
        TensorDataset of images, float32 (N, 1, 28, 28) normalized with the MNIST mean
        and std, and labels, int64 (N,).

    Raises:
        ConfigError: If the folder or a file is missing, or the files are malformed or
            disagree on the number of examples.
    """
    if not os.path.isdir(directory):
        raise ConfigError(
            f"MNIST directory {directory!r} does not exist; pass a folder holding "
            f"{IMAGES_FILE} and {LABELS_FILE} (optionally .gz)"
        )
    images = read_idx(_find_or_raise(directory, IMAGES_FILE), _IMAGES_MAGIC)  # (N, H, W)
    labels = read_idx(_find_or_raise(directory, LABELS_FILE), _LABELS_MAGIC)  # (N,)
    if len(images) != len(labels):
        raise ConfigError(
            f"MNIST files in {directory!r} disagree: {len(images)} images but "
            f"{len(labels)} labels; use an images and labels file from the same split"
        )
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)  # (N, 1, H, W)
    x = (x - MNIST_MEAN) / MNIST_STD
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def load_digits() -> TensorDataset:
    """Load scikit-learn's bundled handwritten digits (1797 real 8x8 images).

    Returns:
        TensorDataset of images, float32 (N, 1, 8, 8) scaled to [0, 1] and then
        standardized to zero mean and unit variance over the whole set, and labels,
        int64 (N,).
    """
    # Imported here because scikit-learn takes a while to import and only this loader needs it.
    try:
        from sklearn.datasets import load_digits as sklearn_load_digits
    except ImportError:
        raise ConfigError(
            "the built-in digits data needs scikit-learn: pip install 'ddpkit[demos]', or pass --data DIR "
            "with MNIST IDX files"
        ) from None

    bunch = sklearn_load_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    x = (x - x.mean()) / x.std()
    return TensorDataset(x, torch.from_numpy(bunch.target.astype(np.int64)))
