"""Prepare the wheels ``benchmarks/gpu_check.py`` needs on a lent GPU machine.

    python benchmarks/gpu_wheels.py            # into .whl/ (git ignores it)

The GPU machines this project is lent run Python 3.12 with torch 2.11 (CUDA), sympy,
numpy, pandas and absl-py, and reach no package registry; OR-Tools (the planner's CP-SAT)
is not there. This script downloads, for CPython 3.12 on manylinux x86-64 and without
their dependencies, the versions installed here (so the GPU run plans with the solver the
tests use): ``ortools``, ``immutabledict`` and ``protobuf`` (OR-Tools' generated code
needs its protobuf range, ``protobuf<6.34,>=6.33.1`` for 9.15, which the GPU image's own
protobuf need not satisfy). About 30 MB. The README's "GPU check" paragraph gives the
command that installs them there (``pip install --no-index --target``) and runs the check.

Raises SystemExit naming the package when pip cannot download one.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ortools", "immutabledict", "protobuf")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def download(folder: Path, python_version: str = "3.12") -> list[Path]:
    """Download :data:`PACKAGES` (the versions installed here) into ``folder``; returns the
    wheels there."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        spec = f"{name}=={md.version(name)}"
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "-d", str(folder), spec]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"gpu_wheels: pip could not download {spec} for CPython "
                             f"{python_version}; see its message above")
    return sorted(folder.glob("*.whl"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--to", type=Path, default=REPO / ".whl", help="folder (default .whl/)")
    args = p.parse_args(argv)
    wheels = download(args.to)
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 1e6:6.1f} MB  {w.name}")
    print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB in {args.to}")


if __name__ == "__main__":
    main()
