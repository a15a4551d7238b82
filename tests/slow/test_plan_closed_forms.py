"""GPT-3-175B- and Llama-3-70B-shaped models planned for 1024 A100s (128 DGX nodes) in one
process on the meta device: the plans are found (the chosen config solves to proven
optimality), their predicted FLOPs equal the closed forms, and their predicted memory per
GPU (every pipeline rank, every kind) equals the closed forms under Megatron's placements
(:mod:`autopar.oracle.plan_forms`). Planning times are the benchmark's business
(``benchmarks/plan_large.py`` prints them); nothing here is timed. About 20 s on 2 cores
(40 s when other work shares them)."""

from __future__ import annotations

import pytest

import autopar
from autopar.planner.costs.tables import Config
from autopar.planner.search import SearchContext, solve_one
from autopar.contract.support import RUNTIME_SUPPORT
from helpers import load_script

bench = load_script("benchmarks/plan_large.py")
NODES = 128


@pytest.fixture(scope="module", params=list(bench.MODELS))
def case(request):
    if request.param.startswith("llama"):
        pytest.importorskip("transformers")
    return bench.plan_case(request.param, NODES)


def test_plan_is_found_and_its_config_solves_to_optimality(case):
    plan = case.plan
    assert plan.num_gpus == NODES * 8
    assert plan.predicted.peak_memory_bytes <= case.cluster.device.memory_bytes
    cfg = Config(plan.tp, plan.pp, plan.dp, plan.micro_batch_size, plan.num_micro_batches,
                 plan.schedule, plan.virtual_stages, plan.dtype, case.cluster.attention,
                 plan.sequence_parallel)
    ctx = SearchContext.of(case.traced, case.cluster, autopar.Layout(), RUNTIME_SUPPORT)
    decision, status, _, _ = solve_one(ctx, cfg)
    assert status == "OPTIMAL"
    assert decision.stage_layers == plan.stage_layers


def test_predicted_flops_equal_the_closed_forms(case):
    for what, predicted, closed in bench.flops_rows(case):
        assert predicted == pytest.approx(closed, rel=bench.REL_TOL), what


def test_predicted_memory_equals_the_closed_forms_under_megatron_placements(case):
    rows = bench.memory_rows(case)
    assert len(rows) == 4 * case.plan.pp
    for rank, kind, closed, priced, _ in rows:
        assert priced == pytest.approx(closed, rel=bench.REL_TOL), (rank, kind)
