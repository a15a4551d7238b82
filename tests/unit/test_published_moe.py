"""The published mixture-of-experts rows (benchmarks/published_moe_runs.py): Megatron-LM's
FLOPs count turns each published TFLOP/s into the published step time, which is what
autopar's prediction is compared with, and the report lists every row with its source.

Pricing the rows (two 94-layer and one 56-layer traces, about a minute) is the benchmark's
job, not this tier's; here the arithmetic and the report's contents are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

bench = load_script("benchmarks/published_moe_runs.py")
REPORT = Path(__file__).resolve().parents[2] / "reports" / "published_vs_predicted.md"


def test_megatron_flops_reproduce_the_model_zoos_step_times():
    """Megatron's count per token (Mixtral 8x22B 242.17 GFLOP, Qwen3-235B-A22B 148.03 at
    s = 4096) turns the Qwen3 readme's TFLOP/s into the step times it publishes beside them
    (245 TFLOP/s: 19.7 s; 167: 29.0 s) to within its rounding."""
    per_token = {r.family: bench.megatron_flops_per_token(r.config, r.seq) / 1e9
                 for r in bench.MOE_RUNS}
    assert per_token["mixtral"] == pytest.approx(242.17, abs=0.01)
    assert per_token["qwen3_moe"] == pytest.approx(148.03, abs=0.01)
    steps = {r.published: bench.published_step_s(r) for r in bench.MOE_RUNS}
    assert steps[245.0] == pytest.approx(19.7, rel=0.006)
    assert steps[167.0] == pytest.approx(29.0, rel=0.006)


def test_qwen3_chunks_count_embedding_and_loss_as_layers():
    """--account-for-embedding/loss-in-pipeline-split: 94 layers + 2 over 32 chunks of 3
    units, the first and last chunk one decoder layer short."""
    chunks = bench.qwen3_chunks(8, 4)
    sizes = [hi - lo for lo, hi in chunks]
    assert len(chunks) == 32 and sizes[0] == sizes[-1] == 2 and set(sizes[1:-1]) == {3}
    assert chunks[0][0] == 0 and chunks[-1][1] == 94


def test_the_report_lists_every_moe_row_with_its_source_and_what_is_not_priced():
    report = REPORT.read_text(encoding="utf-8")
    section = bench.existing_section(REPORT)
    assert section and section in report, "regenerate: python benchmarks/published_moe_runs.py"
    for run in bench.MOE_RUNS:
        assert f"| {run.name} |" in section
        assert run.source in section
        for item in run.unpriced:
            assert item in section
    assert "FP8" in section and "DualPipe" in section
