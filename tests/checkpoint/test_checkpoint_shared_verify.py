"""Checkpoints verified where their bytes are: each rank hashes its share of the files at resume
(every file once, by one rank) and a bad file anywhere sends every rank back to the previous
checkpoint together; writers hash what they write (tests/checkpoint/shared_verify_cases.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import ddpkit
from ddpkit.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint, verify_checkpoint
from ddpkit.checkpoint.manifest import file_entry, read_manifest, share, verify_share
from ddpkit.launch.start_method import FORKSERVER

sys.path.insert(0, str(Path(__file__).parent))
from shared_verify_cases import hashed_resuming, hashed_training, read_resuming, train  # noqa: E402


def test_the_ranks_shares_cover_every_file_once(tmp_path):
    import torch

    path = save_checkpoint(tmp_path, 1, {"a": torch.ones(3)})
    manifest = read_manifest(path)
    for name in ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata"):  # a sharded checkpoint's
        (path / name).write_bytes(name.encode())
        manifest["files"][name] = {"xxh3_128": file_entry(path / name)["xxh3_128"], "bytes": len(name)}
    (path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    (path / "__1_0.distcp").write_bytes(b"__1_0.distcX")  # the same size, another hash
    names = sorted(manifest["files"])
    # On the world size that wrote them, each rank its own shards (which it loads), state.pt on
    # every rank (each loads it whole), the rest spread.
    assert [share(names, rank, 3) for rank in range(3)] == [
        ["state.pt", "__0_0.distcp", ".metadata"],
        ["state.pt", "__1_0.distcp"],
        ["state.pt", "__2_0.distcp"],
    ]
    # On another, DCP's files spread over the ranks (each rank loads parts of several).
    assert [share(names, rank, 2) for rank in range(2)] == [
        ["state.pt", ".metadata", "__1_0.distcp"],
        ["state.pt", "__0_0.distcp", "__2_0.distcp"],
    ]
    for world in (2, 3):  # every file hashed by some rank before any is loaded
        assert {n for rank in range(world) for n in share(names, rank, world)} == set(names)
    found = [verify_share(path, rank, 3) for rank in range(3)]
    assert found == [[], ["xxh3_128 mismatch in __1_0.distcp"], []]
    assert verify_checkpoint(path) == found[1]  # the same finding as one rank hashing everything


def test_a_loaded_checkpoint_holds_no_mapping_of_its_file(tmp_path):
    """state.pt is loaded mapped (its pages come from storage once) and every tensor is then
    copied out: an optimizer keeping one as its state would hold a rotated checkpoint's disk."""
    import torch

    path = save_checkpoint(
        tmp_path, 1, {"a": torch.arange(6.0), "nested": [{"b": torch.ones(2)}, (torch.zeros(1),)]}
    )
    state = load_checkpoint(path)
    tensors = [state["a"], state["nested"][0]["b"], state["nested"][1][0]]
    (path / "state.pt").unlink()
    import gc

    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(path / "state.pt") not in maps
    assert torch.equal(tensors[0], torch.arange(6.0)) and torch.equal(tensors[1], torch.ones(2))


@pytest.mark.slow
def test_a_shard_corrupted_on_disk_sends_every_rank_back_to_the_previous_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    assert ddpkit.launch(train, 2, (out, 6), start_method=FORKSERVER) == [1, 1]
    newest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert newest.name == "step-00000006" and verify_checkpoint(newest) == []  # the writers' hashes hold
    shard = newest / "__0_0.distcp"  # in rank 1's share of the files at resume
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit flipped, the size the same: only a hash sees it
    shard.write_bytes(bytes(data))
    assert ddpkit.launch(train, 2, (out, 8), start_method=FORKSERVER) == [
        5,
        5,
    ]  # resumed from step 4 on both ranks


def _bytes(folder: Path, pattern: str) -> int:
    return sum(path.stat().st_size for path in folder.glob(pattern))


@pytest.mark.slow
def test_each_rank_reads_nothing_back_at_save_and_its_share_at_resume(tmp_path):
    """The bytes each rank reads to hash, counted: at save none (each file is hashed as it is
    written, and its manifest entry is right), at resume its share of the chosen checkpoint, each
    file once; choosing it reads manifests and sizes only."""
    out = str(tmp_path / "run")
    saved = ddpkit.launch(hashed_training, 2, (out, 6), start_method=FORKSERVER)
    written = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [path.name for path in written] == ["step-00000002", "step-00000004", "step-00000006"]
    assert saved == [0, 0]  # nothing read back at save
    assert all(verify_checkpoint(path) == [] for path in written)  # the digests taken on the way out
    for path in written:  # every file the folder holds is in its manifest
        assert set(read_manifest(path)["files"]) == {p.name for p in path.iterdir()} - {"manifest.json"}
    resumed = ddpkit.launch(hashed_resuming, 2, (out, 8), start_method=FORKSERVER)
    names = sorted(read_manifest(written[-1])["files"])
    shares = [sum((written[-1] / name).stat().st_size for name in share(names, rank, 2)) for rank in (0, 1)]
    assert resumed == shares
    state = (written[-1] / "state.pt").stat().st_size  # hashed by both ranks: each loads it whole
    assert sum(shares) - state == _bytes(written[-1], "*") - (written[-1] / "manifest.json").stat().st_size
    for rank in (0, 1):  # on the world size that wrote it, each rank hashes the shards it loads back
        assert f"__{rank}_0.distcp" in share(names, rank, 2)


@pytest.mark.slow
def test_each_rank_reads_its_share_once_at_resume(tmp_path):
    """Counted from Run() to the end of the first batch (/proc/self/io's rchar, plus the files
    hashed through a mapping): the DCP files a rank hashes are the ones it loads, mapped from the
    hash to the loads, so it reads its share once (within 10%, plus the manifest and DCP's
    .metadata), not once to hash and again to load. The optimizer's state is made from the
    checkpoint's metadata: no optimizer step at lr 0."""
    out = str(tmp_path / "run")
    fresh = ddpkit.launch(read_resuming, 2, (out, 2, 512), start_method=FORKSERVER)  # what a run reads anyway
    path = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    read = ddpkit.launch(read_resuming, 2, (out, 4, 512), start_method=FORKSERVER)
    names = sorted(read_manifest(path)["files"])
    extra = _bytes(path, "manifest.json") + _bytes(path, ".metadata")
    for rank in (0, 1):
        mine = sum((path / name).stat().st_size for name in share(names, rank, 2))
        assert mine > 4 * 2**20 and f"__{rank}_0.distcp" in share(names, rank, 2)  # the shards dominate
        more = read[rank][0] - fresh[rank][0]
        assert more <= 1.1 * mine + extra, (rank, read[rank], fresh[rank], mine, extra)
    assert [steps for _, steps in read] == [0, 0]  # only the loop's own
