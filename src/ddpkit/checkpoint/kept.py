"""A rank's share of the chosen checkpoint, read from storage once: the DCP files it hashes at
resume stay in host memory, and the DCP loads that follow read them from there.

The ranks verify the checkpoint before anything loads it (docs/guarantees.md says why: the step a
resumed run shows from ``Run()`` on is the one it continues, and a bad file sends every rank back
together before any weight is used). Without this each byte a rank loads would be read twice,
hashed and then loaded: the second time from the page cache on one machine, from storage again
on a parallel or network file system that does not keep it.

The price is host memory: the share (about S/N of the checkpoint, its DCP files only; state.pt is
loaded mapped) from ``Run()`` until the loop's first batch has loaded the last part. A share over
``budget`` (a quarter of the memory available, over the machine's ranks) is not kept: those
files are read twice, and rank 0 says so in one line.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.files import DIGESTS, count_hashed
from ddpkit.checkpoint.manifest import DCP_FILE, DCP_METADATA


class KeptFiles:
    """The DCP files of one checkpoint folder that this rank hashed at resume, by name.

    Args:
        folder: the checkpoint folder.
        budget: the most bytes to keep; a share over it is hashed in chunks and not kept.
    """

    def __init__(self, folder: Path, budget: int) -> None:
        self.folder, self.budget = Path(folder), budget
        self.files: dict[str, bytes] = {}
        self.not_kept = 0  # the bytes of this rank's share that did not fit the budget

    @staticmethod
    def wanted(name: str) -> bool:
        """True for the files a DCP load reads (its shard files and ``.metadata``)."""
        return name == DCP_METADATA or DCP_FILE.fullmatch(name) is not None

    def plan(self, names: list[str], manifest: dict) -> list[str]:
        """The names among ``names`` to keep: every wanted one when their bytes fit the budget
        together, none otherwise (then ``not_kept`` holds their bytes)."""
        wanted = [name for name in names if self.wanted(name)]
        total = sum(manifest["files"][name]["bytes"] for name in wanted)
        if total > self.budget:
            self.not_kept = total
            return []
        return wanted

    def check(self, name: str, entry: dict) -> str | None:
        """Read the file ``name`` whole (once), hash it against its manifest ``entry`` and keep its
        bytes when they match; the problem found, or None."""
        try:
            data = (self.folder / name).read_bytes()
        except FileNotFoundError:
            return f"missing {name}"
        except OSError as exc:
            return f"cannot read {name} ({exc.strerror or exc})"
        if len(data) != entry["bytes"]:
            return f"size mismatch in {name} ({len(data)} bytes, manifest says {entry['bytes']})"
        kind = next(k for k in DIGESTS if k in entry)
        count_hashed(len(data))
        if DIGESTS[kind](data).hexdigest() != entry[kind]:
            return f"{kind} mismatch in {name}"
        self.files[name] = data
        return None

    def reader(self) -> Any:
        """DCP's ``FileSystemReader`` over the folder, whose kept files are read from memory.
        ``.metadata`` (read by every load) is kept once read, on every rank."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.filesystem import FileSystem

        files = self.files

        class KeptFileSystem(FileSystem):
            @contextlib.contextmanager
            def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
                name = Path(path).name
                if mode == "rb" and name == DCP_METADATA and name not in files:
                    files[name] = Path(path).read_bytes()
                if mode != "rb" or name not in files:
                    with super().create_stream(path, mode) as stream:
                        yield stream
                    return
                yield io.BytesIO(files[name])  # shares the bytes: nothing is copied until a read

        reader = FileSystemReader(str(self.folder))
        reader.fs = KeptFileSystem()  # the one FileSystem the reader opens every file through
        return reader

    def kept_bytes(self) -> int:
        """The bytes held now."""
        return sum(len(data) for data in self.files.values())

    def release(self) -> None:
        """Drop every kept file: the loads that read them are done."""
        self.files.clear()


def budget(local_world_size: int) -> int:
    """A quarter of the memory available now (Linux ``MemAvailable``), over this machine's ranks;
    0 where it cannot be read (nothing kept)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0
    return kib * 1024 // (4 * max(local_world_size, 1))
