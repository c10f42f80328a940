"""The manifest that makes a checkpoint checkable: what files it holds, their sizes and digests
(xxh3_128; sha256 in manifests written before it, still verified: checkpoint/files.py).

``manifest.json`` is written last, so a checkpoint directory without one never finished; a size
or hash that disagrees with it means the bytes changed after the save (truncated copy, bad disk).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import NotImplementedType

from ddpkit.checkpoint.files import DIGEST, DIGESTS, digest_file
from ddpkit.version import __version__

Keep = Callable[[str, dict], str | NotImplementedType | None]  # verify_share's check-and-keep of a file

FORMAT = 1
MANIFEST = "manifest.json"
STATE = "state.pt"
STEP_DIR = re.compile(r"step-(\d{8,})")
DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # the file of DCP's rank r: __r_0.distcp
DCP_METADATA = ".metadata"  # DCP's plan of every file: what each key is and where its bytes are


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint for ``step``: ``step-00000100``."""
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory is named after, or None for any other name."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def write_manifest(directory: Path, step: int, names: list[str], known: dict | None = None) -> dict:
    """Write (and fsync) the manifest of the files ``names`` in ``directory``: the entries in
    ``known`` (name -> digest and size, hashed by the rank that wrote the file), and
    for any other file its hash read now."""
    known = known or {}
    files = {name: known.get(name) or file_entry(directory / name) for name in names}
    manifest = {
        "format": FORMAT,
        "step": step,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ddpkit_version": __version__,
        "files": files,
    }
    with open(directory / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def file_entry(path: Path) -> dict:
    """A file's manifest entry, read from disk: its digest and size."""
    return {DIGEST: digest_file(path), "bytes": path.stat().st_size}


def read_manifest(directory: Path) -> dict:
    """The parsed manifest of a checkpoint directory.

    Raises:
        FileNotFoundError: there is no manifest.
        ValueError: it is not a format-1 manifest (bad JSON, wrong fields, unsafe file names).
    """
    file = directory / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(file)
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:  # unreadable (permissions, I/O error) is a bad manifest, not a missing one
        raise ValueError(exc.strerror or str(exc)) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"expected a dict with format {FORMAT}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(_entry_ok(name, e) for name, e in files.items()):
        raise ValueError('"files" must map plain file names to {"xxh3_128" (or "sha256"): str, "bytes": int}')
    return manifest


def _entry_ok(name: object, entry: object) -> bool:
    # Plain names only: a manifest must not make verification read outside its checkpoint.
    plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
    return (
        plain
        and isinstance(entry, dict)
        and any(isinstance(entry.get(kind), str) for kind in DIGESTS)
        and isinstance(entry.get("bytes"), int)
    )


def verify_checkpoint(path: str | Path) -> list[str]:
    """Check a checkpoint directory against its manifest.

    Args:
        path: a checkpoint directory such as ``OUT/checkpoints/step-00000100``.

    Returns:
        The problems found, each a short phrase ("xxh3_128 mismatch in state.pt"); empty when good.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory" if path.exists() else f"{path} does not exist"]
    return _problems(path, _check_file)


def quick_problems(path: Path) -> list[str]:
    """What is visibly wrong with a checkpoint without reading its files' contents: its manifest,
    and each listed file's presence and size. Choosing a checkpoint reads this much; the hashes
    are checked by the ranks that read the files (``verify_share``)."""
    return _problems(Path(path), _check_size)


def _problems(path: Path, check) -> list[str]:
    """The manifest's problems and each listed file's, as ``check(file, entry)`` finds them."""
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        return [f"missing {MANIFEST}"]
    except ValueError as exc:
        return [f"unreadable {MANIFEST} ({exc})"]
    found = [check(path / name, entry) for name, entry in manifest["files"].items()]
    return [p for p in found if p] + manifest_problems(path, manifest)


def verify_share(path: Path, rank: int, world_size: int, keep: Keep | None = None) -> list[str]:
    """The problems of this rank's share of a checkpoint's files (``share``), each hashed here;
    ``keep(name, entry)`` checks a file first and keeps it for the loads to come (it returns
    NotImplemented for a file it leaves to the read calls here: checkpoint/kept.py)."""
    try:
        manifest = read_manifest(path)
    except (FileNotFoundError, ValueError) as exc:
        return [f"unreadable {MANIFEST} ({exc})"]
    found = []
    for name in share(sorted(manifest["files"]), rank, world_size):
        entry = manifest["files"][name]
        problem = keep(name, entry) if keep is not None else NotImplemented
        found.append(_check_file(path / name, entry) if problem is NotImplemented else problem)
    return [p for p in found if p]


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files of a checkpoint that ``rank`` hashes at resume, so that each file is hashed
    before any is loaded and each rank reads from storage what it loads, once (the load then finds
    those pages in this machine's page cache).

    state.pt: every rank, which loads it whole (mapped: ``load_checkpoint(mmap=True)``). DCP's
    files: on the world size that wrote them, rank r's own ``__r_*.distcp`` (the shards it loads
    back); on another, every ``world_size``-th of them. The rest (``.metadata``) every
    ``world_size``-th from ``rank`` on.
    """
    writers = {int(m.group(1)) for name in names if (m := DCP_FILE.fullmatch(name))}
    same = writers == set(range(world_size))
    mine = [n for n in names if (m := DCP_FILE.fullmatch(n)) and int(m.group(1)) == rank] if same else []
    rest = [n for n in names if n != STATE and not (same and DCP_FILE.fullmatch(n))]
    return ([STATE] if STATE in names else []) + mine + rest[rank::world_size]


def manifest_problems(path: Path, manifest: dict) -> list[str]:
    """What is wrong with a readable manifest itself: no state file listed, or another step's."""
    problems = [] if STATE in manifest["files"] else [f"{MANIFEST} does not list {STATE}"]
    step = step_of(path)
    if step is not None and manifest.get("step") != step:
        problems.append(f"{MANIFEST} says step {manifest.get('step')} but the directory is {path.name}")
    return problems


def verify_files(path: Path, manifest: dict) -> dict[str, str | None]:
    """Each file the manifest lists, with its problem, or None when its size and digest match.

    Args:
        path: the checkpoint directory.
        manifest: its manifest, from ``read_manifest``.
    """
    return {name: _check_file(path / name, entry) for name, entry in manifest["files"].items()}


def _check_size(path: Path, entry: dict) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"missing {path.name}"
    if size != entry["bytes"]:
        # A size mismatch (a truncated copy, typically) settles it without reading the file.
        return f"size mismatch in {path.name} ({size} bytes, manifest says {entry['bytes']})"
    return None


def _check_file(path: Path, entry: dict) -> str | None:
    if (problem := _check_size(path, entry)) is not None:
        return problem
    kind = next(k for k in DIGESTS if k in entry)
    try:
        digest = digest_file(path, kind)
    except OSError as exc:
        return f"cannot read {path.name} ({exc.strerror or exc})"
    if digest != entry[kind]:
        return f"{kind} mismatch in {path.name}"
    return None
