"""Whole-or-absent checkpoint directories (autopar.runtime.checkpoint_files) in one process
(group=None), on plain files: the staging, manifest and commit steps, an interrupted
commit, damaged files and the choice of the newest complete checkpoint. The same steps over
gloo ranks with DCP's files, and crashes inside them, are in
tests/multiprocess/test_checkpoint_faults.py."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from autopar.runtime.checkpoint_files import (MANIFEST, CheckpointError, CheckpointWarning,
                                              commit, latest_checkpoint, read_manifest,
                                              resolve_checkpoint, staging_dir, verify_checkpoint,
                                              write_manifest)

FILES = {"__0_0.distcp": b"rank zero's tensors" * 100, "__1_0.distcp": b"rank one" * 50,
         ".metadata": b"dcp metadata"}


def _save(target, step: int, files=FILES):
    """The three steps of a save with ``files`` as DCP's output."""
    staging = staging_dir(target, None)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    manifest = write_manifest(staging, step, None)
    commit(staging, target, None)
    return manifest


def test_a_save_commits_its_files_with_a_manifest_of_sizes_and_sha256(tmp_path):
    target = tmp_path / "ckpt" / "latest"
    manifest = _save(target, 7)
    assert sorted(p.name for p in target.iterdir()) == sorted([*FILES, MANIFEST])
    assert manifest.steps_done == 7 and manifest.world_size == 1
    assert manifest.files == {n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in FILES.items()}
    assert read_manifest(target) == manifest
    assert verify_checkpoint(target) == manifest
    assert json.loads((target / MANIFEST).read_text())["steps_done"] == 7


def test_a_save_over_a_checkpoint_replaces_it_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "latest"
    _save(target, 1)
    stale = tmp_path / ".latest.staging-deadbeef"  # a crashed save's leftover
    stale.mkdir()
    _save(target, 2, {"__0_0.distcp": b"new", ".metadata": b"m"})
    assert read_manifest(target).steps_done == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert not (target / "__1_0.distcp").exists()  # none of the old files remain


def test_a_save_interrupted_before_its_commit_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "latest"
    want = _save(target, 1)
    staging = staging_dir(target, None)
    (staging / "__0_0.distcp").write_bytes(b"half of the new")  # then the crash
    assert verify_checkpoint(resolve_checkpoint(target)) == want


def test_a_commit_interrupted_between_its_renames_loads_the_previous_checkpoint(tmp_path):
    target = tmp_path / "latest"
    want = _save(target, 1)
    os.rename(target, tmp_path / ".latest.previous-0123456789ab")  # the first rename only
    with pytest.warns(CheckpointWarning, match="interrupted while replacing it"):
        found = resolve_checkpoint(target)
    assert found.name == ".latest.previous-0123456789ab" and verify_checkpoint(found) == want
    _save(target, 2)  # the next save cleans it away
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_no_checkpoint_and_no_staging_place_are_typed_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at .*missing"):
        resolve_checkpoint(tmp_path / "missing")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="making the staging directory beside .*file/x"):
        staging_dir(tmp_path / "file" / "x", None)


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped", "grown", "manifest",
                                 "garbled manifest"])
def test_each_damage_is_named(tmp_path, how):
    target = tmp_path / "c"
    _save(target, 1)
    shard = target / "__1_0.distcp"
    if how == "deleted":
        shard.unlink()
    elif how == "truncated":
        os.truncate(shard, 3)
    elif how == "flipped":
        data = bytearray(shard.read_bytes())
        data[5] ^= 0x80
        shard.write_bytes(bytes(data))
    elif how == "grown":
        shard.write_bytes(shard.read_bytes() + b"x")
    elif how == "manifest":
        (target / MANIFEST).unlink()
    else:
        (target / MANIFEST).write_text("{\"format\": 1")
    named = MANIFEST if "manifest" in how else "__1_0.distcp"
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        verify_checkpoint(target)


def test_sizes_alone_miss_a_flipped_byte_that_checksums_catch(tmp_path):
    target = tmp_path / "c"
    _save(target, 1)
    data = bytearray((target / ".metadata").read_bytes())
    data[0] ^= 1
    (target / ".metadata").write_bytes(bytes(data))
    verify_checkpoint(target, checksums=False)
    with pytest.raises(CheckpointError, match=r"\.metadata has another SHA-256"):
        verify_checkpoint(target)


def test_the_latest_checkpoint_is_the_newest_complete_one_and_the_skipped_are_named(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path / f"step_{step:06d}", step)
    os.truncate(tmp_path / "step_000030" / "__0_0.distcp", 1)
    (tmp_path / "step_000040").mkdir()  # a save that never finished: DCP files only
    (tmp_path / "step_000040" / ".metadata").write_bytes(b"m")
    (tmp_path / "notes").mkdir()  # not a checkpoint
    scan = latest_checkpoint(tmp_path)
    assert scan.latest == tmp_path / "step_000020"
    assert [p.name for p, _ in scan.skipped] == ["step_000040", "step_000030"]  # newest first
    assert "incomplete" in scan.skipped[0][1] and "has 1 bytes" in scan.skipped[1][1]
    assert [p.name for p in scan.candidates] == ["step_000040", "step_000030", "step_000020",
                                                 "step_000010"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert latest_checkpoint(empty).latest is None
    with pytest.raises(CheckpointError, match="not a directory"):
        latest_checkpoint(tmp_path / "absent")


def _pm_stub():
    """What ``checkpoint._named_failures`` reads of a ParallelizedModel: its groups' names,
    rank and timeout."""
    from datetime import timedelta
    from types import SimpleNamespace

    group = SimpleNamespace(group_name="7")
    groups = SimpleNamespace(checkpoint_group=group, rank=1, timeout=timedelta(seconds=5),
                             axis_names=lambda: {})
    return SimpleNamespace(groups=groups)


def test_dcp_failures_become_typed_errors_naming_the_file_or_the_collective():
    from torch.distributed.checkpoint.api import CheckpointException

    from autopar.runtime.checkpoint import _named_failures
    from autopar.runtime.health import CollectiveError

    missing = FileNotFoundError(2, "No such file or directory", "/ckpt/__3_0.distcp")
    with pytest.raises(CheckpointError, match=r"loading checkpoint /ckpt failed on rank 1 at "
                                              r"step 4 in file /ckpt/__3_0\.distcp"):
        with _named_failures(_pm_stub(), "loading checkpoint", "/ckpt", 4):
            raise CheckpointException("read failed", {3: (missing, None)})  # a BaseException
    with pytest.raises(CollectiveError, match=r"saving checkpoint /ckpt: step 4 on rank \d+: .*"
                                              r"Connection closed by peer"):
        with _named_failures(_pm_stub(), "saving checkpoint", "/ckpt", 4):
            raise RuntimeError("[gloo] Connection closed by peer")
    with pytest.raises(ValueError, match="another model"):  # our own errors pass unchanged
        with _named_failures(_pm_stub(), "loading checkpoint", "/ckpt", 4):
            raise ValueError("another model")
