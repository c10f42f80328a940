"""A rank's share of the chosen checkpoint, read from storage once: the DCP files it hashes at
resume stay mapped, and the DCP loads that follow read them through those mappings.

The ranks verify the checkpoint before anything loads it (docs/guarantees.md says why: the step a
resumed run shows from ``Run()`` on is the one it continues, and a bad file sends every rank back
together before any weight is used). Read through read calls, each byte a rank loads would be
read twice, hashed and then loaded, the second time from the page cache if the pages are still
there when the load comes (the optimizer's at the loop's first batch, after the script's own
start-up). Mapped (``mmap``, populated at once) the pages are read from storage once, hashed
where they lie (no copy), and held by the mapping until the last load has read them: mapped
pages stay cached until the machine runs short of memory, when the kernel may drop them (they
are clean) rather than fail; a load then reads those again. A file that cannot be mapped (a
file system without mmap) is hashed through read calls and read again by the load.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from types import NotImplementedType
from typing import Any

from ddpkit.checkpoint.files import DIGESTS, count_hashed
from ddpkit.checkpoint.manifest import DCP_FILE, DCP_METADATA


class KeptFiles:
    """The DCP files of one checkpoint folder that this rank hashed at resume, mapped, by name.

    Args:
        folder: the checkpoint folder.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.maps: dict[str, mmap.mmap] = {}
        self.metadata: Any = None  # DCP's .metadata, parsed once (tens of ms a parse for a GPT)

    @staticmethod
    def wanted(name: str) -> bool:
        """True for the files a DCP load reads (its shard files and ``.metadata``)."""
        return name == DCP_METADATA or DCP_FILE.fullmatch(name) is not None

    def check(self, name: str, entry: dict) -> str | NotImplementedType | None:
        """Map the file ``name``, hash it against its manifest ``entry`` and keep the mapping when
        they match; the problem found, or None; NotImplemented when it is no file a load reads or
        cannot be mapped (empty, or on a file system without mmap), for the caller to hash it
        through read calls (``manifest.verify_share``)."""
        if not self.wanted(name):
            return NotImplemented
        try:
            with open(self.folder / name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry["bytes"]:
                    return f"size mismatch in {name} ({size} bytes, manifest says {entry['bytes']})"
                populate = getattr(mmap, "MAP_POPULATE", 0)  # Linux: read it all in now, in one call
                mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
        except FileNotFoundError:
            return f"missing {name}"
        except (OSError, ValueError):  # unmappable: the caller's read calls say what is wrong, if anything
            return NotImplemented
        kind = next(k for k in DIGESTS if k in entry)
        count_hashed(size, mapped=True)
        if DIGESTS[kind](mapped).hexdigest() != entry[kind]:
            mapped.close()
            return f"{kind} mismatch in {name}"
        self.maps[name] = mapped
        return None

    def reader(self) -> Any:
        """DCP's ``FileSystemReader`` over the folder, whose kept files are read through their
        mappings and whose ``.metadata`` (which every load reads) is parsed once, on every rank."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.filesystem import FileSystem

        kept = self

        class KeptFileSystem(FileSystem):
            @contextlib.contextmanager
            def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
                mapped = kept.maps.get(Path(path).name) if mode == "rb" else None
                if mapped is None:
                    with super().create_stream(path, mode) as stream:
                        yield stream
                    return
                yield MappedStream(mapped)

        class KeptReader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                if kept.metadata is None:
                    kept.metadata = super().read_metadata(*args, **kwargs)
                kept.metadata.storage_meta.load_id = self.load_id  # what DCP's own read sets
                return kept.metadata

        reader = KeptReader(str(self.folder))
        reader.fs = KeptFileSystem()  # the one FileSystem the reader opens every file through
        return reader

    def release(self) -> None:
        """Unmap every kept file: the loads that read them are done."""
        maps, self.maps, self.metadata = self.maps, {}, None
        for mapped in maps.values():
            with contextlib.suppress(BufferError):  # a view still open: unmapped when it goes
                mapped.close()


class MappedStream(io.RawIOBase):
    """A read-only, seekable file over a mapping, with a position of its own (the mapping's is
    shared by every stream over it)."""

    def __init__(self, mapped: mmap.mmap) -> None:
        super().__init__()
        self.mapped, self.pos = mapped, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: len(self.mapped)}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = len(self.mapped) if size is None or size < 0 else min(self.pos + size, len(self.mapped))
        data = self.mapped[self.pos : end]  # one copy, out of the mapped pages
        self.pos = max(end, self.pos)
        return data

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        size = max(min(len(target), len(self.mapped) - self.pos), 0)
        with memoryview(self.mapped) as view:
            target[:size] = view[self.pos : self.pos + size]
        self.pos += size
        return size
