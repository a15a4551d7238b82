"""Published Megatron-LM runs priced by autopar.evaluate land within 10% of the paper.

The rows, their sources and the one fitted constant per hardware profile live in
``benchmarks/published_runs.py`` (run it to regenerate reports/published_vs_predicted.md).
A row the cost model cannot reach carries its reason (``known_gap``) and is an xfail here
with that reason; every other row must be within ``TOLERANCE`` (10%, with no per-row
constant: one fitted ``matmul_efficiency`` per hardware profile).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

REPO = Path(__file__).resolve().parents[2]


bench = load_script("benchmarks/published_runs.py")


def _param(run):
    marks = [pytest.mark.xfail(reason=run.known_gap, strict=False)] if run.known_gap else []
    return pytest.param(run, id=run.name.replace(" ", "_"), marks=marks)


@pytest.mark.parametrize("run", [_param(run) for run in bench.RUNS])
def test_published_run_within_tolerance(run):
    assert bench.TOLERANCE <= 0.10
    predicted = bench.evaluate_run(run).predicted.tflops_per_gpu
    error = (predicted - run.published) / run.published
    assert abs(error) < bench.TOLERANCE, (
        f"{run.name}: predicted {predicted:.1f} TFLOP/s per GPU, published {run.published} "
        f"({error:+.1%}); source: {run.source}")


def test_one_calibration_row_per_profile_and_its_source_in_the_preset():
    """Exactly one fitted number per hardware profile, and the preset says which run."""
    profiles = {run.cluster for run in bench.RUNS}
    for profile in profiles:
        calibrations = [r for r in bench.RUNS if r.cluster == profile and r.role == "calibration"]
        assert len(calibrations) == 1, profile
        preset = json.loads((REPO / "cost_models" / "presets" / f"{profile}.json").read_text())
        source = preset["device"]["matmul_efficiency"]["source"]
        assert source.startswith("calibrated:")
        run = calibrations[0]
        assert run.source.split(",")[0] in source  # the paper
        assert f"{run.published:g} TFLOP/s" in source  # the figure it was fitted to


def test_every_row_has_a_source_and_the_report_lists_it():
    report = (REPO / "reports" / "published_vs_predicted.md").read_text(encoding="utf-8")
    for run in bench.RUNS:
        assert run.source and run.published > 0
        assert f"| {run.name} |" in report, f"regenerate the report: {run.name} is missing"
        if run.known_gap:
            assert f"**{run.name}**" in report
