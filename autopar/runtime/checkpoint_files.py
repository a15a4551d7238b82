"""Checkpoint directories that are whole or absent: a staging directory, a manifest of
checksums written last, and an atomic rename into place.

:mod:`autopar.runtime.checkpoint` decides *what* a checkpoint holds; this module decides
how its files reach the disk so that a crash at any moment leaves either the previous
checkpoint or the new one, never a mix, and so that a damaged file is named on load
instead of loaded. A save of ``DIR/NAME`` (collective over the checkpoint group, every rank
in the same order):

1. rank 0 draws a token, broadcast to all; every rank writes its files (DCP's
   ``FileSystemWriter``) into the staging directory ``DIR/.NAME.staging-TOKEN``; DCP's
   coordinator writes ``.metadata`` once every rank's writes are done;
2. rank 0 lists the staging directory; rank r hashes (SHA-256) the files r, r + N, ...; the
   digests are gathered and rank 0 writes :data:`MANIFEST` (bytes and SHA-256 per file,
   the step), through a temporary file, fsync and rename: the manifest is the last file;
3. rank 0 commits: an existing ``DIR/NAME`` is renamed to ``DIR/.NAME.previous-TOKEN``,
   the staging directory to ``DIR/NAME``, the previous one removed, the directory fsynced;
   then a barrier, so every rank returns with the checkpoint in place.

A crash in steps 1-2 leaves ``DIR/NAME`` untouched (the next successful save of the same
name removes the stale staging directory). A crash between the two renames of step 3
leaves no ``DIR/NAME`` but a complete ``.NAME.previous-TOKEN``, which
:func:`resolve_checkpoint` finds and loads (with a warning). Rename is atomic on a POSIX
file system (also on NFS and Lustre within a directory), which DCP's own ``.metadata``
write relies on too. One job saves a given name at a time.

On load, every file of the manifest must exist with its size (every rank checks all, a
``stat`` each) and its SHA-256 (rank r hashes files r, r + N, ...); the findings are
gathered so that every rank raises the same :class:`CheckpointError`, naming the file,
before any state is modified. SHA-256 runs at about 0.8 GB/s per core on this machine's
CPU (SHA-NI): ``python benchmarks/checkpoint_io.py`` prints the cost of the manifest on a
save and of the verification on a load for a model of a few hundred MB.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["MANIFEST", "CheckpointError", "CheckpointWarning", "Manifest", "staging_dir",
           "write_manifest", "commit", "on_rank0", "resolve_checkpoint", "read_manifest",
           "file_problems", "verify_checkpoint", "agreed", "latest_checkpoint", "CheckpointScan"]

MANIFEST = "autopar.manifest.json"
MANIFEST_FORMAT = "autopar-checkpoint-manifest"
MANIFEST_VERSION = 1
_CHUNK = 1 << 22  # bytes read at a time when hashing


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as it is: missing, incomplete (no manifest: a save did
    not finish), or a file that is missing, of another size or of another SHA-256 than its
    manifest says. The message names the checkpoint and the file."""


class CheckpointWarning(UserWarning):
    """A load that does something the user may not expect, on purpose: an interrupted
    save's previous checkpoint loaded, RNG streams restarted under another layout, or
    hyperparameters (the learning rate) taken from the checkpoint."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a complete checkpoint holds, written last by the save.

    Attributes:
        steps_done: optimizer steps the saved state had taken.
        world_size: ranks that wrote it.
        files: relative path -> (size in bytes, SHA-256 hex digest), every file but the
            manifest itself.
    """

    steps_done: int
    world_size: int
    files: dict[str, tuple[int, str]]

    def to_json(self) -> str:
        return json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                           "steps_done": self.steps_done, "world_size": self.world_size,
                           "files": {k: {"bytes": n, "sha256": h}
                                     for k, (n, h) in sorted(self.files.items())}}, indent=1)


def sha256_file(path: Path) -> str:
    """The SHA-256 hex digest of the file at ``path`` (read in 4 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def agreed(value: Any, group) -> Any:
    """Rank 0's ``value`` on every rank of ``group`` (a broadcast; none in a world of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    box = [value if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def on_rank0(fn: Callable[[], Any], group, what: str) -> Any:
    """``fn()`` run on rank 0 of ``group``, its value on every rank; the CheckpointError or
    OSError it raised (an OSError's message naming ``what``) raised as a CheckpointError on
    every rank, so that a file-system failure on rank 0 does not leave the others waiting.
    Collective over ``group``."""
    outcome = None
    if group is None or dist.get_rank(group) == 0:
        try:
            outcome = ("ok", fn())
        except CheckpointError as exc:
            outcome = ("error", str(exc))
        except OSError as exc:
            outcome = ("error", f"{what} failed on rank 0: {type(exc).__name__}: {exc}")
    kind, value = agreed(outcome, group)
    if kind == "error":
        raise CheckpointError(value)
    return value


def staging_dir(target: Path, group) -> Path:
    """Step 1: the staging directory of a save to ``target``, made empty by rank 0, the
    same on every rank. Collective over ``group``. Raises CheckpointError when it cannot
    be made (naming it)."""
    def make() -> str:
        staging = target.parent / f".{target.name}.staging-{uuid.uuid4().hex[:12]}"
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        return str(staging)
    return Path(on_rank0(make, group, f"making the staging directory beside {target}"))


def _my_share(names: list[str], group) -> list[str]:
    if group is None:
        return names
    return names[dist.get_rank(group)::dist.get_world_size(group)]


def _gather(value: Any, group) -> list:
    if group is None or dist.get_world_size(group) == 1:
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _hash_share(staging: Path, names: list[str], group) -> dict[str, tuple[int, str]]:
    """(size, SHA-256) of this rank's share of ``names``, gathered from every rank; a file
    that cannot be read on any rank raises CheckpointError on all. Collective."""
    mine, error = {}, None
    try:
        for n in _my_share(names, group):
            mine[n] = (os.path.getsize(staging / n), sha256_file(staging / n))
    except OSError as exc:
        error = f"hashing {exc.filename} failed: {type(exc).__name__}: {exc}"
    parts = _gather((mine, error), group)
    errors = [e for _, e in parts if e]
    if errors:
        raise CheckpointError(errors[0])
    return {k: v for files, _ in parts for k, v in files.items()}


def write_manifest(staging: Path, steps_done: int, group) -> Manifest:
    """Step 2: hash the staging directory's files (each rank its share), gather, and write
    the manifest on rank 0 (last, atomically). Collective over ``group``. Raises
    CheckpointError when a file cannot be read or the manifest written."""
    names = on_rank0(lambda: sorted(p.name for p in staging.iterdir() if p.is_file()), group,
                     f"listing {staging}")
    world = 1 if group is None else dist.get_world_size(group)
    manifest = Manifest(steps_done=steps_done, world_size=world,
                        files=_hash_share(staging, names, group))

    def write() -> None:
        tmp = staging / f".{MANIFEST}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, staging / MANIFEST)
        _fsync_dir(staging)
    on_rank0(write, group, f"writing {staging / MANIFEST}")
    return manifest


def _leftovers(target: Path) -> list[Path]:
    return [p for kind in ("staging", "previous")
            for p in target.parent.glob(f".{target.name}.{kind}-*")]


def commit(staging: Path, target: Path, group) -> None:
    """Step 3: rank 0 moves ``staging`` to ``target`` (the previous checkpoint aside first,
    then removed, with the leftovers of interrupted saves of ``target``); every rank
    returns once it is in place. Collective over ``group``. Raises CheckpointError when a
    rename fails (naming the directories)."""
    def rename() -> None:
        previous = target.parent / f".{target.name}.previous-{staging.name.rsplit('-', 1)[1]}"
        if target.exists():
            os.rename(target, previous)
        os.rename(staging, target)
        _fsync_dir(target.parent)
        for stale in _leftovers(target):
            shutil.rmtree(stale, ignore_errors=True)
    on_rank0(rename, group, f"moving {staging} to {target}")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The directory to load for ``path``: ``path`` itself, or, when a save was interrupted
    between its two renames (no ``path``), the complete previous checkpoint it had set
    aside (a :class:`CheckpointWarning` says so). Local.

    Raises CheckpointError when neither exists."""
    path = Path(path)
    if path.is_dir():
        return path
    aside = sorted(p for p in path.parent.glob(f".{path.name}.previous-*")
                   if (p / MANIFEST).is_file())
    if aside:
        warnings.warn(f"{path} is missing: a save was interrupted while replacing it; loading "
                      f"the previous checkpoint it had set aside, {aside[-1]}",
                      CheckpointWarning, stacklevel=3)
        return aside[-1]
    raise CheckpointError(f"no checkpoint at {path} (no such directory); pass the directory "
                          "save_checkpoint wrote")


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint directory ``path``. Local.

    Raises CheckpointError when it is missing (an incomplete save) or unreadable."""
    file = path / MANIFEST
    if not file.is_file():
        dcp_only = (path / ".metadata").is_file()
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MANIFEST}, which a save writes last "
            + ("(it holds DCP files: a save that did not finish, or one written by another "
               "tool)" if dcp_only else "(a save that did not finish)"))
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {raw.get('format')!r}")
        files = {k: (int(v["bytes"]), str(v["sha256"])) for k, v in raw["files"].items()}
        return Manifest(steps_done=int(raw["steps_done"]), world_size=int(raw["world_size"]),
                        files=files)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{file} is not an autopar checkpoint manifest ({exc})") from None


def file_problems(path: Path, manifest: Manifest, *, hash_names: list[str]) -> list[str]:
    """What is wrong with the files of checkpoint ``path`` against ``manifest``: every
    file's existence and size, and the SHA-256 of those in ``hash_names``; one line per
    damaged file, naming it. Local."""
    problems = []
    for name, (size, digest) in sorted(manifest.files.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif (got := file.stat().st_size) != size:
            problems.append(f"{file} has {got} bytes, the manifest {size} (truncated or "
                            "overwritten)")
        elif name in hash_names and sha256_file(file) != digest:
            problems.append(f"{file} has another SHA-256 than its manifest (its bytes changed)")
    return problems


def verify_checkpoint(path: str | os.PathLike, group=None, *, checksums: bool = True) -> Manifest:
    """Check the checkpoint at ``path`` against its manifest and return the manifest.
    Collective over ``group`` when given (each rank hashes its share of the files; every
    rank raises the same error); local with ``group=None`` (this process hashes all).

    Raises CheckpointError naming the first damaged file (and how many are damaged), or
    the missing manifest."""
    path = Path(path)
    manifest, error = None, None
    try:
        manifest = read_manifest(path)
        names = _my_share(sorted(manifest.files), group) if checksums else []
        problems = file_problems(path, manifest, hash_names=names)
    except CheckpointError as exc:
        error, problems = str(exc), []
    found = sorted({p for part in _gather((error, problems), group) for p in
                    ([part[0]] if part[0] else []) + part[1]})
    if found:
        more = f" ({len(found) - 1} more problem(s))" if len(found) > 1 else ""
        raise CheckpointError(f"{found[0]}{more}; this checkpoint cannot be loaded: load an "
                              "earlier one (latest_checkpoint(directory) finds the newest "
                              "complete one)")
    return manifest


@dataclass(frozen=True, kw_only=True)
class CheckpointScan:
    """What :func:`latest_checkpoint` found in a directory.

    Attributes:
        latest: the newest complete checkpoint (None: none).
        skipped: (directory, why) of each checkpoint newer than ``latest`` that is not
            complete, newest first.
        candidates: every checkpoint directory found, newest first: by the step of its
            manifest (without one, the last number in its name), then by name.
    """

    latest: Path | None
    skipped: tuple[tuple[Path, str], ...]
    candidates: tuple[Path, ...]


def _step_of(path: Path) -> int:
    """The step a checkpoint directory holds: its manifest's, else (an incomplete save) the
    last number in its name (``step_000040`` -> 40), else -1."""
    try:
        return read_manifest(path).steps_done
    except CheckpointError:
        digits = re.findall(r"\d+", path.name)
        return int(digits[-1]) if digits else -1


def latest_checkpoint(directory: str | os.PathLike, *, checksums: bool = False) -> CheckpointScan:
    """The newest complete checkpoint among the subdirectories of ``directory`` that hold a
    manifest or DCP's ``.metadata`` (hidden staging directories left out). Local.
    ``checksums``: also hash every file (reads the checkpoint; without it the manifest,
    existence and sizes are checked, and a load hashes). Raises CheckpointError when
    ``directory`` is not a directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory of checkpoints")
    found = [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")
             and ((p / MANIFEST).is_file() or (p / ".metadata").is_file())]
    found.sort(key=lambda p: (_step_of(p), p.name), reverse=True)
    skipped = []
    for path in found:
        try:
            verify_checkpoint(path, checksums=checksums)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return CheckpointScan(latest=path, skipped=tuple(skipped), candidates=tuple(found))
    return CheckpointScan(latest=None, skipped=tuple(skipped), candidates=tuple(found))
