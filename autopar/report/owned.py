"""The files a report owns in its directory, so a report written over an older one leaves
none of the older one's files behind (a ``comparison.png`` of hand layouts this report
no longer has, say).

:func:`~autopar.report.document.write_report` records the files it wrote in
:data:`MANIFEST` (``.autopar-report.json``: ``{"files": [...]}``) beside ``report.md``.
Before writing it reads what an earlier report there owned (:func:`owned_files`): the
manifest's files, or, beside a ``report.md`` written before manifests existed, the chart
files of :data:`~autopar.report.plots.CHART_FILES`. After writing, the earlier report's
files this one did not write are removed (:func:`remove_stale`); any other file in the
directory (a saved plan.json, the user's notes) is never touched.
"""

from __future__ import annotations

import json
from pathlib import Path

from autopar.report.plots import CHART_FILES

__all__ = ["MANIFEST", "owned_files", "write_manifest", "remove_stale"]

MANIFEST = ".autopar-report.json"


def _plain_name(name: object) -> bool:
    """A file name in the report's own directory: no folder, no ``..``, not the manifest."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST)
            and Path(name).name == name and "\\" not in name)


def owned_files(out_dir: Path) -> set[str]:
    """The names of the files an earlier report in ``out_dir`` wrote (see the module
    docstring); empty when it holds none."""
    try:
        recorded = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, TypeError, KeyError):
        recorded = None
    if isinstance(recorded, list):
        return {name for name in recorded if _plain_name(name)}
    if (out_dir / "report.md").is_file():  # a report from before manifests
        return set(CHART_FILES.values())
    return set()


def write_manifest(out_dir: Path, files: set[str]) -> None:
    """Record the names of the files this report wrote in ``out_dir``."""
    record = {"written_by": "autopar.report.write_report", "files": sorted(files)}
    (out_dir / MANIFEST).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def remove_stale(out_dir: Path, earlier: set[str], written: set[str]) -> list[str]:
    """Remove the regular files an earlier report wrote that this one did not; returns
    their names. Links, folders and every other file are left alone."""
    removed = []
    for name in sorted(earlier - written):
        path = out_dir / name
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(name)
    return removed
