"""The command line's output paths: refused before any work, written whole or not at all.

Every verb checks the paths it will write (``-o``, ``--emit-to``, ``--report``, ``--out``)
before it loads a model, solves or measures, so a path that cannot be written costs no
search: :func:`check_file_output` and :func:`check_dir_output` raise ValueError (exit 2)
naming the flag and the path. A directory is known to take new files by creating one, as
the writer will (:func:`_create_temp`), and removing it; permission bits alone do not say
so (root ignores them, yet cannot create files under ``/proc``).

:func:`write_whole` writes a file through a temporary file of its own in the same
directory (created with ``O_EXCL``, so two processes saving one path never share one),
renamed over the path with ``os.replace``: a reader sees the old file or the new one,
never a mix, and a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import argparse
import os
import secrets
import stat
from pathlib import Path

from autopar.contract.plan import Plan

__all__ = ["check_file_output", "check_dir_output", "check_outputs", "write_whole",
           "save_plan"]

_TRIES = 100  # names drawn before giving up on a unique temporary file (2**48 each)


def _create_temp(folder: Path, name: str) -> tuple[int, Path]:
    """A new file of this writer's own in ``folder``, named ``.NAME.<random>.tmp``:
    (descriptor open for writing, path). ``O_EXCL`` makes it never shared; the mode is
    0o666 less the umask, as ``open`` creates files."""
    for _ in range(_TRIES):
        path = folder / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {folder} after {_TRIES} tries")


def _existing_ancestor(path: Path, flag: str) -> Path:
    """The nearest ancestor of ``path`` that exists: the folder that must take new files
    (``path``'s own folder, or the first folder ``mkdir -p`` would create). ValueError
    when it is a file."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path} cannot be written: {parent} is a file, not "
                                 "a directory; give a path under a directory")
            return parent
    raise ValueError(f"{flag} {path} cannot be written: no folder of it exists")


def _check_takes_files(folder: Path, path: Path, flag: str) -> None:
    """ValueError naming ``flag`` and ``path`` when ``folder`` refuses a new file (tried:
    one created and removed at once)."""
    try:
        fd, probe = _create_temp(folder, path.name or "autopar")
    except OSError as exc:
        raise ValueError(f"{flag} {path} cannot be written: {folder} takes no new files "
                         f"({exc.strerror or exc}); give a path in a directory you can "
                         "write") from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def check_file_output(path: Path, flag: str) -> None:
    """Refuse, before any work, a file path ``flag`` cannot write (ValueError, exit 2): a
    directory, a path under a file, a read-only file, or one whose folder takes no new
    files. A device or FIFO that exists (``/dev/null``) is written in place, not probed."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path, e.g. "
                         f"{path / 'plan.json'}")
    folder = _existing_ancestor(path, flag)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is read-only; make it writable (chmod u+w) or give "
                         "another path")
    if path.exists() and not path.is_file():
        return
    _check_takes_files(folder, path, flag)


def check_dir_output(path: Path, flag: str) -> None:
    """Refuse, before any work, a directory path ``flag`` cannot write into (ValueError,
    exit 2): a file, a path under a file, or a folder that takes no new files."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a directory path")
    folder = path if path.is_dir() else _existing_ancestor(path, flag)
    _check_takes_files(folder, path, flag)


def check_outputs(args: argparse.Namespace) -> None:
    """The ``-o FILE`` and ``--report DIR`` of ``plan`` and ``evaluate``, checked before any
    work (ValueError, exit 2)."""
    output, report = getattr(args, "output", None), getattr(args, "report", None)
    if output is not None:
        check_file_output(output, "-o")
    if report is not None:
        check_dir_output(report, "--report")


def write_whole(path: Path, text: str, flag: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file of this writer's own
    beside it, renamed over it (an existing file's mode is kept; a symlink's target is
    replaced, the link kept; a device or FIFO such as ``/dev/null`` is written in place).
    ValueError naming ``flag`` and the path when it cannot be written; no temporary file
    is left."""
    target = Path(os.path.realpath(path))
    tmp = None
    try:
        if target.exists() and not target.is_file():
            target.write_text(text, encoding="utf-8")
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(target.parent, target.name)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            if target.exists():  # a file made group-readable stays so
                os.fchmod(file.fileno(), stat.S_IMODE(target.stat().st_mode))
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ValueError(f"{flag} {path} cannot be written ({exc.strerror or exc}); "
                             "give a file path you can write") from None
        raise


def save_plan(plan: Plan, path: Path, flag: str = "-o") -> None:
    """Write the plan's JSON to ``path`` whole or not at all (:func:`write_whole`)."""
    write_whole(path, plan.to_json() + "\n", flag)
