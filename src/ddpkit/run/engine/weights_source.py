"""Where ``run.setup(model, weights=PATH)`` reads a model's weights: one tensor at a time, by key.

A full state dict file of ``torch.save`` (ddpkit's own ``OUT/model.pt`` among them) is opened
with ``mmap=True``; a ``.safetensors`` file through ``safetensors.safe_open``; a HuggingFace
folder through its ``model.safetensors``, or its ``model.safetensors.index.json`` and the shard
files it names, or a ``pytorch_model.bin``. Nothing is read until a tensor is asked for, and then
only that tensor, or the part of it a rank's shard holds (``get_part``: its rows), so no rank
holds the whole file in its own memory, nor touches more of it than its share.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ddpkit.errors import ConfigError

INDEX = "model.safetensors.index.json"
FOLDER_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt")


class WeightsSource:
    """The tensors of one weights file or folder, by state-dict key, read on demand.

    Args:
        path: a ``torch.save`` file, a ``.safetensors`` file, or a HuggingFace model folder.

    Raises:
        ConfigError: the path does not exist, holds no weights ddpkit reads, or safetensors is
            not installed for a safetensors file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, object] = {}  # file name -> its open reader
        self._where: dict[str, str] = {}  # key -> file name
        if self.path.is_dir():
            self._open_folder()
        elif self.path.is_file():
            self._open(self.path.name, self.path)
        else:
            raise ConfigError(
                f"weights={str(path)!r} does not exist; give a state dict file or a model folder"
            )

    def _open_folder(self) -> None:
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]  # key -> shard file
            for name in sorted(set(weight_map.values())):
                self._open(name, self.path / name, keys=False)
            self._where = dict(weight_map)
            return
        found = next((self.path / name for name in FOLDER_FILES if (self.path / name).is_file()), None)
        if found is None:
            raise ConfigError(
                f"weights={str(self.path)!r} is a folder without {INDEX} or any of "
                f"{', '.join(FOLDER_FILES)}; give the file itself, or a folder written by save_pretrained"
            )
        self._open(found.name, found)

    def _open(self, name: str, path: Path, keys: bool = True) -> None:
        if path.suffix == ".safetensors":
            try:
                from safetensors import safe_open
            except ImportError:
                raise ConfigError(
                    f"weights={str(path)!r} is a safetensors file; pip install safetensors to read it"
                ) from None
            reader = safe_open(str(path), framework="pt", device="cpu")
            names = list(reader.keys())
        else:
            try:
                reader = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's one line
                raise ConfigError(
                    f"weights={str(path)!r} is not a state dict torch.load can read ({type(exc).__name__}); "
                    "give a torch.save file of model.state_dict(), a .safetensors file or a model folder"
                ) from None
            if not isinstance(reader, dict) or not all(isinstance(v, torch.Tensor) for v in reader.values()):
                raise ConfigError(
                    f"weights={str(path)!r} holds a {type(reader).__name__}, not a state dict of "
                    "tensors; save model.state_dict() (a checkpoint of ddpkit's is for resume, not weights=)"
                )
            names = list(reader)
        self._files[name] = reader
        if keys:
            self._where.update(dict.fromkeys(names, name))

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def get(self, key: str) -> torch.Tensor:
        """The tensor saved under ``key``: a view of the mapped file, copied by whoever uses it."""
        reader = self._files[self._where[key]]
        return reader[key] if isinstance(reader, dict) else reader.get_tensor(key)

    def get_part(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The part ``index`` (one slice a dimension) of the tensor under ``key``, reading only its
        bytes: a view of the mapped ``torch.save`` file (the pages of those rows), or
        safetensors' ``get_slice`` (those bytes read)."""
        reader = self._files[self._where[key]]
        return reader[key][index] if isinstance(reader, dict) else reader.get_slice(key)[index]
