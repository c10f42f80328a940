"""Sharded checkpoints: every rank writes its shards through torch.distributed.checkpoint (DCP),
inside the same atomic, verified checkpoint folder as a full one.

A sharded checkpoint folder::

    step-00000100/   state.pt  (rank 0: step, generators, loader, every unsharded object;
                                each sharded entry is the marker SHARDED)
                     .metadata  __0_0.distcp  __1_0.distcp ...  (DCP: every rank's shards)
                     manifest.json  (digests of all of them, written last)

Rank 0 makes the hidden temporary folder and broadcasts its name, every rank writes its shards
into it with DCP (``sync_files``: each file fsynced), each file hashed as its bytes go out
(``HashingWriter``: nothing is read back), and once DCP's own gather says every rank has
written, rank 0 gathers the hashes, writes state.pt (hashed as it is written too) and the
manifest of every file and renames the folder into place
(``store.commit_save``). A kill at any point leaves a hidden folder that is never loaded.
With ``async_save`` the same steps run in each rank's writer thread (``save_sharded_async``).
DCP reshards on load, so the checkpoint resumes on any number of processes. The folder must be
one every rank can read and write (a shared filesystem across machines), as DCP requires.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint.background import BackgroundWriter
from ddpkit.checkpoint.files import HashedWrite
from ddpkit.checkpoint.kept import KeptFiles
from ddpkit.checkpoint.manifest import STATE
from ddpkit.checkpoint.store import CheckpointError, begin_save, commit_save

# What state.pt holds in place of a part whose tensors are in the DCP files.
SHARDED = {"ddpkit_sharded": "torch.distributed.checkpoint"}


def hashing_writer(path: Path) -> Any:
    """DCP's ``FileSystemWriter`` over ``path`` (each file fsynced) whose files are hashed as they
    are written: after the save, its ``entries`` map each file this rank wrote (its shards; on the
    coordinator ``.metadata`` too) to its manifest entry."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.entries: dict[str, dict] = {}

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with HashedWrite(open(path, mode)) as stream:
                yield stream
            # DCP writes .metadata as .metadata.tmp and renames it; a thread a file, one key each.
            self.entries[Path(path).name.removesuffix(".tmp")] = stream.entry()

    writer = FileSystemWriter(path, sync_files=True)
    writer.fs = HashingFileSystem()  # the one FileSystem the writer opens every file through
    return writer


def is_sharded_entry(value: object) -> bool:
    """True for the marker of a part saved through DCP."""
    return isinstance(value, dict) and value.get("ddpkit_sharded") == SHARDED["ddpkit_sharded"]


def save_sharded(
    directory: Path, step: int, state: dict | None, shards: dict[str, Any], rank0: bool, keep_last: int
) -> Path | None:
    """Checkpoint ``shards`` (name -> a Stateful: ``state_dict()`` of DTensors) through DCP on every
    rank and ``state`` (rank 0's; None elsewhere) beside them, atomically. Collective.

    Returns:
        The checkpoint folder on rank 0, None on the other ranks.
    """
    import torch.distributed.checkpoint as dcp  # a second of imports, for sharded runs only

    final, tmp = _begin(directory, step, state, rank0, keep_last)
    try:
        writer = hashing_writer(tmp)
        dcp.save(shards, storage_writer=writer)
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(final, tmp, step, state, rank0, keep_last, None, writer.fs.entries)


def save_sharded_async(
    directory: Path,
    step: int,
    state: dict | None,
    shards: dict[str, Any],
    rank0: bool,
    keep_last: int,
    writer: BackgroundWriter,
) -> Path | None:
    """``save_sharded`` in the background (``async_save``); the folder it will be on rank 0.
    Collective.

    The step waits for the last write to land (one at a time) and on rank 0 for a host copy of
    ``state``; DCP's ``async_save`` copies this rank's shards into host memory in a thread of the
    stager's, which the run waits for before it changes them (``BackgroundWriter.wait_staged``). Then each
    rank's writer thread lets DCP write its files, hashes them and sends the digests to rank 0's,
    which commits the folder as ``save_sharded`` does. The threads' collectives (DCP's plan, the
    digests) go over a gloo group of their own, so they never interleave with the training's.
    """
    import torch.distributed.checkpoint as dcp

    writer.wait()  # on every rank: begin_save on rank 0 clears what an unfinished write left
    if writer.group is None:  # made once, by every rank at the same (collective) save
        writer.group = dist.new_group(backend="gloo")
    final, tmp = _begin(directory, step, state, rank0, keep_last)
    storage = hashing_writer(tmp)
    writer.stage_synchronize()
    response = dcp.async_save(
        shards,
        storage_writer=storage,
        process_group=writer.group,
        async_stager=writer.stager,  # its host buffers serve every save of the run
    )
    # The stager copies in the background: DCP answers with the copy's future and the write's
    # (an older torch with the write's alone, once its stager has copied).
    writer.staged = getattr(response, "staging_completion", None)
    shards_written = getattr(response, "upload_completion", response)
    copied = writer.copy(state) if rank0 else None
    group = writer.group

    def land() -> None:
        shards_written.result()
        _commit(final, tmp, step, copied, rank0, keep_last, group, storage.fs.entries)

    writer.submit(land)
    return final if rank0 else None


def _begin(directory: Path, step: int, state: dict | None, rank0: bool, keep_last: int) -> tuple[Path, Path]:
    """Rank 0 makes the hidden temporary folder; every rank learns its name. Collective."""
    chosen: list = [None, None]
    if rank0:
        try:
            chosen = [begin_save(directory, step, state, keep_last), None]
        except Exception as exc:  # every rank raises it, instead of waiting in DCP for rank 0
            chosen = [None, f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(chosen, src=0)
    if chosen[1] is not None:
        raise CheckpointError(f"cannot start the sharded checkpoint of step {step}: {chosen[1]}")
    return chosen[0]


def _commit(
    final: Path,
    tmp: Path,
    step: int,
    state: dict | None,
    rank0: bool,
    keep_last: int,
    group: Any,
    mine: dict[str, dict],
) -> Path | None:
    """Rank 0 gathers the entries of the files each rank hashed as it wrote them (``mine``) and
    commits: the checkpoint is hashed in S/N a rank, on its way to the disk, and read back by
    none. Collective over ``group`` (None: the default group)."""
    everyone: list[dict] | None = [{}] * dist.get_world_size() if rank0 else None
    dist.gather_object(mine, everyone, dst=0, group=group)
    if not rank0:
        return None
    # DCP's save returns on rank 0 after its gather of every rank's write results: all files are in.
    files = tuple(sorted(p.name for p in tmp.iterdir() if p.name != STATE))
    known = {name: entry for entries in everyone for name, entry in entries.items()}
    return commit_save(final, tmp, step, state, keep_last, files, known)


def load_sharded(path: str | Path, shards: dict[str, Any], kept: KeptFiles | None = None) -> None:
    """Load the DCP part of the checkpoint at ``path`` into ``shards`` (name -> Stateful), resharded
    to this run's ranks. The folder was verified against its manifest when it was chosen; the
    files this rank hashed then are read from ``kept`` (each byte from storage once).

    Each rank plans its reads alone (``no_dist``): a load's plan needs nothing from the other ranks
    (each DTensor knows its own shard), and DCP's gather and scatter of every rank's plan cost
    time on every load, more with more ranks (docs/fsdp.md, "What it costs"). Every rank holds
    the same keys (one model, one optimizer), so a key DCP cannot find fails every rank alike."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is not
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(shards, storage_reader=_reader(path, kept), no_dist=True)


def saved_keys(path: str | Path, kept: KeptFiles | None = None) -> set[str]:
    """The flattened keys (``model.h.0.attn.c_attn.weight``) the DCP part at ``path`` holds."""
    return set(saved_layout(path, kept))


def saved_layout(path: str | Path, kept: KeptFiles | None = None) -> dict[str, Any]:
    """Each flattened key of the DCP part at ``path`` with what is saved there (a tensor's
    ``size`` and ``properties.dtype``, or bytes), from its ``.metadata``."""
    return dict(_reader(path, kept).read_metadata().state_dict_metadata)


def _reader(path: str | Path, kept: KeptFiles | None) -> Any:
    import torch.distributed.checkpoint as dcp

    if kept is None:
        return dcp.FileSystemReader(str(path))
    assert kept.folder == Path(path), f"files kept from {kept.folder}, loading {path}"
    return kept.reader()
