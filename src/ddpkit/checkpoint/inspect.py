"""``ddpkit inspect PATH``: what a checkpoint holds, and whether its files still match the manifest.

PATH is a checkpoint directory, a directory of them (a run's ``checkpoints/``, or the run's
``--out``), or a single ``.pt`` file such as ``OUT/model.pt``. Exit code 0 when everything
verifies, 1 when a problem was found, 2 when PATH does not exist.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from ddpkit.checkpoint.files import DIGEST, DIGESTS, digest_file
from ddpkit.checkpoint.manifest import (
    MANIFEST,
    STATE,
    manifest_problems,
    read_manifest,
    step_of,
    verify_files,
)
from ddpkit.checkpoint.store import list_checkpoints
from ddpkit.errors import ConfigError, OneLineParser

FIRST_NAMES = 3  # tensor names shown per state_dict
WIDTH = 100  # characters of a value's summary before it is cut


def main(argv: list[str]) -> int:
    """Run ``ddpkit inspect``; returns the exit code (0 good, 1 problem found, 2 bad PATH).

    Args:
        argv: the arguments after ``inspect``.
    """
    parser = OneLineParser(prog="ddpkit inspect", description=__doc__.split("\n")[0])
    parser.add_argument("path", help="checkpoint directory, directory of checkpoints, or .pt file")
    try:
        path = Path(parser.parse_args(argv).path)
        if not path.exists():
            raise ConfigError(
                f"{str(path)!r} does not exist; pass a checkpoint directory (OUT/checkpoints/step-N), "
                "a run's checkpoints directory, or a .pt file"
            )
    except ConfigError as exc:
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 2
    return inspect_path(path)


def inspect_path(path: Path) -> int:
    """Print what ``path`` holds; 0 when everything verifies, 1 when a problem was found."""
    if path.is_file():
        if path.name == STATE and (path.parent / MANIFEST).exists():
            return inspect_checkpoint(path.parent)
        return inspect_file(path)
    if (path / MANIFEST).exists() or (path / STATE).exists() or step_of(path) is not None:
        return inspect_checkpoint(path)
    checkpoints = list_checkpoints(path) or list_checkpoints(path / "checkpoints")
    if not checkpoints:
        print(f"{path}: no checkpoint here (no {MANIFEST}, no step-* directories)")
        return 1
    print(f"{len(checkpoints)} checkpoints in {checkpoints[0].parent}")
    codes = []
    for checkpoint in checkpoints:
        print()
        codes.append(inspect_checkpoint(checkpoint))
    return max(codes)


def inspect_checkpoint(path: Path) -> int:
    """Print a checkpoint's manifest, each file's check, and a summary of its state."""
    print(f"checkpoint {path}")
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        print(f"  PROBLEM: missing {MANIFEST}; the save never finished, or the file was deleted")
        return 1
    except ValueError as exc:
        print(f"  PROBLEM: unreadable {MANIFEST} ({exc})")
        return 1
    for key in ("step", "created", "ddpkit_version"):
        print(f"  {key:<15} {manifest.get(key, '?')}")
    checked = verify_files(path, manifest)
    for name, entry in manifest["files"].items():
        problem = checked[name]
        kind = next(k for k in DIGESTS if k in entry)
        status = f"{kind} ok" if problem is None else f"MISMATCH ({problem})"
        print(f"  {name:<15} {format_bytes(entry['bytes']):>10}  {status}")
    problems = [p for p in checked.values() if p] + manifest_problems(path, manifest)
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    if problems:
        print("  state not loaded: the checkpoint is corrupt")
        return 1
    return _print_state(path / STATE)


def inspect_file(path: Path) -> int:
    """Print a lone ``.pt`` file's size, digest (nothing to check it against) and state summary."""
    print(f"file {path}")
    print(f"  {'size':<15} {format_bytes(path.stat().st_size)}")
    print(f"  {DIGEST:<15} {digest_file(path)} (no manifest to check it against)")
    return _print_state(path)


def _print_state(path: Path) -> int:
    try:
        state = _load(path)
    except Exception as exc:  # whatever fails (bad zip, refused global, EOF) is the finding to report
        print(f"  PROBLEM: cannot load {path.name}: {str(exc).splitlines()[0][:200]}")
        return 1
    for line in summarize(state):
        print(f"  {line}")
    return 0


def _load(path: Path) -> object:
    try:
        # mmap: only the pickle is read, so inspecting a large checkpoint costs little memory.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        # Files from torch.save(_use_new_zipfile_serialization=False) cannot be mapped.
        return torch.load(path, map_location="cpu", weights_only=True)


def summarize(state: object) -> list[str]:
    """Lines describing a loaded state: per top-level key, a tensor summary or a short repr.

    Args:
        state: what ``torch.load`` returned.
    """
    if _is_tensor_dict(state):
        return [f"state: {tensor_summary(state)}"]
    if not isinstance(state, dict):
        return [f"state: {brief(state)}"]
    lines = [f"state: {len(state)} keys: {', '.join(map(str, state))}"]
    width = max(len(str(k)) for k in state) if state else 0
    for key, value in state.items():
        text = tensor_summary(value) if _is_tensor_dict(value) else brief(value)
        lines.append(f"  {str(key):<{width}}  {text}")
    return lines


def _is_tensor_dict(value: object) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, Tensor) for v in value.values())


def tensor_summary(tensors: dict[str, Tensor]) -> str:
    """``"4 tensors, 1,234 parameters, float32; fc.weight (16, 8), fc.bias (16,), ..."``."""
    params = sum(t.numel() for t in tensors.values())
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    names = [f"{name} {tuple(t.shape)}" for name, t in list(tensors.items())[:FIRST_NAMES]]
    more = ", ..." if len(tensors) > FIRST_NAMES else ""
    return f"{len(tensors)} tensors, {params:,} parameters, {'/'.join(dtypes)}; {', '.join(names)}{more}"


def brief(value: object, depth: int = 0) -> str:
    """A repr cut to ``WIDTH`` characters, with tensors as dtype and shape, and nesting counted not shown."""
    if isinstance(value, Tensor):
        if value.dim() == 0:
            return f"tensor({value.item()})"
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, dict):
        if depth >= 1:
            return f"dict({_count(len(value), 'entry', 'entries')})"
        text = "{" + ", ".join(f"{k!r}: {brief(v, depth + 1)}" for k, v in value.items()) + "}"
    elif isinstance(value, (list, tuple)):
        if depth >= 1 or len(value) > 4:
            return f"{type(value).__name__}({_count(len(value), 'item', 'items')})"
        text = "[" + ", ".join(brief(v, depth + 1) for v in value) + "]"
    else:
        text = repr(value)
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
