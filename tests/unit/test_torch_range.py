"""The torch versions autopar declares are the ones it is tested on (tests/oldest_torch.sh
runs this tier again on the oldest), and the names that differ between them resolve."""

from __future__ import annotations

import tomllib

import torch
import torch.distributed as dist
from packaging.requirements import Requirement

from autopar.runtime import compat
from helpers import REPO

TESTED = ("2.11.0", "2.13.0")  # tests/oldest_torch.sh's default, and the main environment's


def _torch_requirement() -> Requirement:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if r.startswith("torch")]
    return torch_req


def test_the_declared_range_holds_the_tested_versions_and_this_one():
    specifier = _torch_requirement().specifier
    for version in TESTED:
        assert specifier.contains(version), (str(specifier), version)
    here = torch.__version__.split("+")[0]
    assert specifier.contains(here), f"torch {here} runs these tests but {specifier} excludes it"
    assert not specifier.contains("2.10.0") and not specifier.contains("2.14.0"), str(specifier)


def test_the_collectives_whose_names_changed_resolve_on_this_torch():
    assert compat.all_gather_single in (getattr(dist, "all_gather_single", None),
                                        dist.all_gather_into_tensor)
    assert compat.reduce_scatter_single in (getattr(dist, "reduce_scatter_single", None),
                                            dist.reduce_scatter_tensor)
    assert callable(compat.all_gather_single) and callable(compat.reduce_scatter_single)
