"""Shared fixtures for every tier (tests/unit, tests/slow, tests/multiprocess).

The builders themselves live in tests/helpers.py (a plain module, importable by spawned
gloo ranks too); these fixtures hand them to tests that prefer injection. ``golden``
compares generated text with a checked-in file; ``AUTOPAR_UPDATE_GOLDEN=1`` rewrites it.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Callable

import pytest

import helpers
from autopar.models import GPT, GPTConfig
from cost_models.hardware import Cluster

UPDATE_GOLDEN = "AUTOPAR_UPDATE_GOLDEN"


@pytest.fixture
def gpt_config() -> GPTConfig:
    """The end-to-end test GPT: 4 layers, 4 heads, h = 32, V = 64, s = 16."""
    return helpers.CONFIG


@pytest.fixture
def gpt_model(gpt_config: GPTConfig) -> GPT:
    """``gpt_config``'s GPT, seeded, with random biases (helpers.seeded_gpt)."""
    return helpers.seeded_gpt(gpt_config)


@pytest.fixture
def fast_cluster() -> Callable[[int], Cluster]:
    """``fast_cluster(world)``: A100s on one node with nearly free communication."""
    return helpers.fast_cluster


@pytest.fixture
def cpu_cluster() -> Cluster:
    """This machine as a 4-rank local CPU cluster (the CLI's ``--cluster local-cpu``)."""
    return Cluster.local_cpu(processes=4)


def _compare_golden(path: Path, text: str) -> None:
    if os.environ.get(UPDATE_GOLDEN) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"{path} does not exist; write it with {UPDATE_GOLDEN}=1 python -m pytest {path.parent.parent}")
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(keepends=True), text.splitlines(keepends=True),
                                            fromfile=f"{path} (golden)", tofile="generated"))
        pytest.fail(f"generated text differs from {path}:\n{diff}\nIf the change is intended, "
                    f"regenerate with {UPDATE_GOLDEN}=1 and review the diff.", pytrace=False)


@pytest.fixture
def golden(request) -> Callable[[str, str], None]:
    """``golden(name, text)``: ``text`` must equal golden/<name> beside the test file."""
    folder = Path(request.path).parent / "golden"
    return lambda name, text: _compare_golden(folder / name, text)


# ------------------------------------------------------------ property-test door counts
_DOOR_COUNTS: dict[str, list[int]] = {}  # door -> [inputs seen, accepted]; test-session only


@pytest.fixture(scope="session")
def door_counts() -> Callable[[str, bool], None]:
    """``count(door, accepted)``: tally one generated input of a property test's door; the
    totals are printed at the end of the run (pytest_terminal_summary)."""
    def count(door: str, accepted: bool) -> None:
        seen = _DOOR_COUNTS.setdefault(door, [0, 0])
        seen[0] += 1
        seen[1] += bool(accepted)
    return count


def pytest_terminal_summary(terminalreporter) -> None:
    """How many generated inputs each door of the property tests saw."""
    if _DOOR_COUNTS:
        terminalreporter.section("property-test doors (generated inputs)")
        for door, (seen, accepted) in sorted(_DOOR_COUNTS.items()):
            terminalreporter.write_line(f"{door}: {seen} inputs, {accepted} accepted, "
                                        f"{seen - accepted} refused with a typed error")
