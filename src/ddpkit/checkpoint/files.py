"""Filesystem steps that make a checkpoint durable: hashing, fsync and atomic renames.

A rename is atomic only once the directory entry itself reaches the disk, so every rename is
followed by an fsync of the parent directory; file contents are fsynced before they are renamed,
or a power cut could leave a complete-looking name over empty blocks.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import xxhash

_AT_FDCWD = -100  # Linux: resolve relative paths against the working directory
_RENAME_EXCHANGE = 2  # from <linux/fs.h>


# The digest new manifests record: xxh3_128, a checksum (not a cryptographic hash; the manifest
# guards against torn and corrupted files, not against an attacker), about ten times sha256's
# speed, so hashing a checkpoint again costs about what reading it does (docs/fsdp.md).
# Manifests written before it hold sha256, which is still verified.
DIGESTS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
DIGEST = "xxh3_128"
_hashed = [0]  # bytes digest_file read in this process, for hashed_bytes()
_mapped = [0]  # of those, the bytes hashed through a mapping, for mapped_bytes()


def digest_file(path: Path, kind: str = DIGEST, chunk_bytes: int = 1 << 24) -> str:
    """Hex digest (``kind``: ``xxh3_128`` or ``sha256``) of a file: hashed where its pages lie,
    through a mapping (no copy: 16 ms against 55 ms for 340 MB from the page cache here), or
    read in chunks where it cannot be mapped, so a large checkpoint never sits in memory twice."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else None
        except (OSError, ValueError):  # a file system without mmap
            mapped = None
        if mapped is not None:
            with mapped:
                count_hashed(size, mapped=True)
                return DIGESTS[kind](mapped).hexdigest()
        digest = DIGESTS[kind]()
        while block := f.read(chunk_bytes):
            digest.update(block)
            _hashed[0] += len(block)
    return digest.hexdigest()


class HashedWrite:
    """A file being written whose digest is taken from the bytes on their way out, so that nothing
    is read back to hash it. Written from its start and never sought: its ``tell`` is the bytes
    written (what DCP's writer asks for an item's offset).

    Args:
        raw: the file, opened for writing in binary mode; closed with this.
    """

    def __init__(self, raw: Any) -> None:
        self.raw, self.digest, self.size = raw, DIGESTS[DIGEST](), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self.digest.update(view[:written])
        self.size += written
        return written

    def entry(self) -> dict:
        """The file's manifest entry: its digest and size, as written."""
        assert self.digest is not None, "a file cut short after its bytes were hashed has no entry"
        return {DIGEST: self.digest.hexdigest(), "bytes": self.size}

    def truncate(self, size: int) -> int:
        """Cut the file (a write that failed half-way): its digest is gone with the bytes."""
        self.digest, self.size = None, size
        return self.raw.truncate(size)

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> HashedWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_hashed(size: int, mapped: bool = False) -> None:
    """Count ``size`` bytes hashed outside ``digest_file``; ``mapped``: through a mapping of the
    file (checkpoint/kept.py), which read calls (Linux ``rchar``) do not see."""
    _hashed[0] += size
    _mapped[0] += size if mapped else 0


def mapped_bytes() -> int:
    """The bytes this process has hashed through mappings of their files (``count_hashed``)."""
    return _mapped[0]


def hashed_bytes() -> int:
    """The bytes this process has hashed so far (every checkpoint digest is taken by ``digest_file``):
    what a rank pays for verification at save and at resume, counted."""
    return _hashed[0]


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new, renamed or removed names) to disk.

    Windows cannot open a directory for fsync; there rename durability rests on NTFS journaling.
    """
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    func = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        func.restype = ctypes.c_int
    return func


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the C library, kernel or filesystem lacks it, so the caller can fall back
    to two renames; any other failure raises ``OSError``.

    Args:
        a: the first path.
        b: the second path; afterwards ``a`` names what ``b`` named, and the other way round.
    """
    func = _renameat2()
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def save_state_dict_atomic(state: dict, path: Path) -> None:
    """Write a plain state_dict (CPU tensors) atomically: a crash mid-write leaves the old file.

    The result loads with ``torch.load(path, weights_only=True)``; the temporary file is removed
    if the write fails, so nothing half-written is left beside the old one.

    Raises:
        DiskFullError: the disk filled up; the old file, if any, is untouched.
    """
    tmp = path.with_name(path.name + ".tmp")
    weights = {k: v.detach().cpu() for k, v in state.items()}
    try:
        # Through a Python file: a full disk then surfaces as ENOSPC, where torch's own writer
        # reports only "unexpected pos".
        with open(tmp, "wb") as f:
            torch.save(weights, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written"
        raise_if_disk_full(exc, path, state_bytes(weights), kept)
        raise
    fsync_dir(path.parent)


class DiskFullError(OSError):
    """A checkpoint or weights file did not fit; the message names the path and the bytes needed."""


def raise_if_disk_full(exc: BaseException, target: Path, needed: int, kept: str) -> None:
    """Raise ``DiskFullError`` in place of ``exc`` when it, or what caused it, is ENOSPC or EDQUOT.

    torch's writer turns the file's ``OSError`` into a RuntimeError ("unexpected pos"), keeping
    the OSError as its context, so the whole chain is searched.
    """
    cause: BaseException | None = exc
    while cause is not None and not (
        isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
    ):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return
    parent = next(p for p in (target, *target.parents) if p.exists())
    free = shutil.disk_usage(parent).free
    raise DiskFullError(
        cause.errno,
        f"{os.strerror(cause.errno)} writing {target}: it needs about {needed:,} bytes and {free:,} are "
        f"free there; {kept}; free some space or write to another folder",
    ) from exc


def state_bytes(state: object) -> int:
    """The bytes ``torch.save`` writes for the tensors in ``state`` (each storage once)."""
    seen: dict[int, int] = {}
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(seen.values())
