"""Tests for the MNIST IDX reader (on small files written here) and the scikit-learn digits."""

import gzip

import numpy as np
import pytest

# Imported at collection: scikit-learn sets KMP_* environment variables on first import,
# which the environment-leak check in conftest would otherwise blame on a test.
import sklearn.datasets  # noqa: F401
import torch

from ddpkit.data.digits import MNIST_MEAN, MNIST_STD, load_digits, load_mnist

IMAGES = "train-images-idx3-ubyte"
LABELS = "train-labels-idx1-ubyte"


def _idx_bytes(array: np.ndarray, magic: int) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_mnist(directory, n=3, gz=False, labels_n=None):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(labels_n or n,), dtype=np.uint8)
    for name, blob in ((IMAGES, _idx_bytes(images, 2051)), (LABELS, _idx_bytes(labels, 2049))):
        if gz:
            (directory / (name + ".gz")).write_bytes(gzip.compress(blob))
        else:
            (directory / name).write_bytes(blob)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_reads_idx_files(tmp_path, gz):
    images, labels = _write_mnist(tmp_path, gz=gz)
    x, y = load_mnist(str(tmp_path)).tensors
    assert x.shape == (3, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    expected = (torch.from_numpy(images).float() / 255.0 - MNIST_MEAN) / MNIST_STD
    torch.testing.assert_close(x[:, 0], expected)


def test_load_mnist_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as info:
        load_mnist(str(tmp_path / "absent"))
    assert IMAGES in str(info.value) and LABELS in str(info.value)


def test_load_mnist_missing_file_names_expected_file(tmp_path):
    _write_mnist(tmp_path)
    (tmp_path / LABELS).unlink()
    with pytest.raises(ValueError, match=f"{LABELS}.*not found"):
        load_mnist(str(tmp_path))


def test_load_mnist_rejects_swapped_files(tmp_path):
    _write_mnist(tmp_path)
    images, labels = tmp_path / IMAGES, tmp_path / LABELS
    blob = images.read_bytes()
    images.write_bytes(labels.read_bytes())
    labels.write_bytes(blob)
    with pytest.raises(ValueError, match="magic number 0x00000801, expected 0x00000803"):
        load_mnist(str(tmp_path))


def test_load_mnist_rejects_truncated_file(tmp_path):
    _write_mnist(tmp_path)
    path = tmp_path / IMAGES
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        load_mnist(str(tmp_path))


def test_load_mnist_rejects_count_mismatch(tmp_path):
    _write_mnist(tmp_path, n=3, labels_n=4)
    with pytest.raises(ValueError, match="3 images but 4 labels"):
        load_mnist(str(tmp_path))


def test_load_digits_shapes_and_labels():
    x, y = load_digits().tensors
    assert x.shape == (1797, 1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert sorted(y.unique().tolist()) == list(range(10))
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1.0) < 1e-4
