"""``autopar.evaluate`` prices a hand layout as Megatron-LM runs it, without a search.

Megatron's placements (column-parallel QKV and MLP-in, row-parallel attention-out and
MLP-out; Shoeybi et al. 2019, section 3), layers split evenly over the stages, the
layout's recompute on every layer; the plan is valid, executable and says "EVALUATED".
The 175B published layout against the step time the search-based evaluate gave:
tests/slow/test_planner_175b.py; the evaluated plan under ``verify`` on gloo:
tests/multiprocess/test_evaluate_verify.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.models import GPT, preset
from autopar.contract.plan_check import check_plan
from autopar.contract.stages import even_stage_layers


def _meta(name: str) -> GPT:
    with torch.device("meta"):
        return GPT(preset(name))


@pytest.fixture(scope="module")
def small_tp2():
    """gpt-small-test (4 layers, 4 heads, h = 64, V = 256) at tp=2 on two CPU processes:
    the solver's optimum for these degrees replicates every layer, Megatron splits them."""
    model, cluster = _meta("gpt-small-test"), autopar.Cluster.local_cpu(processes=2)
    layout = autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=1)
    plan = autopar.evaluate(model, cluster, layout, global_batch_size=4, seq_len=64,
                            model_name="gpt-small-test")
    return model, cluster, plan


def test_evaluate_at_tp2_on_local_cpu_uses_megatrons_splits(small_tp2):
    _, _, plan = small_tp2
    p = plan.placements
    for layer in range(4):
        prefix = f"transformer_h_{layer}_"
        for proj in ("attn_c_q", "attn_c_k", "attn_c_v", "mlp_c_fc"):
            assert p[prefix + proj] == "column:S2", (layer, proj)
        assert p[prefix + "attn_c_proj"] == "row:P" and p[prefix + "mlp_c_proj"] == "row:P"
    attention = [n for n in p if n.startswith("scaled_dot_product_attention")]
    assert len(attention) == 4 and all(p[n] == "heads:S1" for n in attention)
    assert p["transformer_wte"] == "vocab:P" and p["transformer_wpe"] == "replicate:R"
    comm = plan.predicted.comm_bytes_by_kind
    assert comm.get("tp_all_gather", 0.0) == 0.0  # no heads gathered: row-parallel out-proj
    # per layer and micro-batch 2 all-reduces of (b, s, h) fp32 forward and 2 backward,
    # plus the vocabulary-parallel embedding's and cross-entropy's: at least 4 per layer
    assert comm["tp_all_reduce"] >= plan.num_micro_batches * 4 * 4 * (1 * 64 * 64 * 4)
    assert plan.solver.status == "EVALUATED"
    assert plan.solver.line().startswith("solver: none, a hand layout priced as written")
    assert "solver:" not in plan.summary()  # an evaluated plan is not "not proven optimal"


def test_evaluate_runs_no_search(monkeypatch, small_tp2):
    model, cluster, plan = small_tp2

    def no_search(*args, **kwargs):
        raise AssertionError("evaluate called the CP-SAT search")

    import autopar.api
    import autopar.planner.search
    import autopar.planner.search.branch_and_bound

    monkeypatch.setattr(autopar.planner.search, "search", no_search)
    monkeypatch.setattr(autopar.planner.search.branch_and_bound, "search", no_search)
    monkeypatch.setattr(autopar.api, "search", no_search)
    again = autopar.evaluate(model, cluster, autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=1),
                             global_batch_size=4, seq_len=64, model_name="gpt-small-test")
    assert again == plan


def test_evaluated_plan_is_valid_executable_and_repriced_alike(small_tp2):
    model, cluster, plan = small_tp2
    check_plan(plan, world_size=2, executable=True)
    assert autopar.Plan.from_json(plan.to_json()) == plan
    repriced = autopar.evaluate_plan(model, cluster, plan)  # the plan's own decisions
    assert repriced.predicted == plan.predicted
    assert plan.alternatives == [] and plan.binding[0].startswith("memory[stage 0]")


def test_evaluate_splits_layers_evenly_and_keeps_recompute_and_schedule():
    model, cluster = _meta("gpt-small-test"), autopar.Cluster.local_cpu(processes=4)
    plan = autopar.evaluate(model, cluster, autopar.Layout.parse("tp=1,pp=4,dp=1,mbs=1,"
                                                                 "recompute=selective"),
                            global_batch_size=8, seq_len=64)
    assert plan.stage_layers == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert plan.recompute == ["selective"] * 4 and plan.schedule == "1f1b"
    interleaved = autopar.evaluate(model, autopar.Cluster.local_cpu(processes=2),
                                   autopar.Layout.parse("tp=1,pp=2,dp=1,mbs=1,v=2"),
                                   global_batch_size=4, seq_len=64)
    assert interleaved.schedule == "interleaved_1f1b" and interleaved.virtual_stages == 2
    assert interleaved.stage_layers == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert interleaved.recompute == ["none"] * 4 and interleaved.zero_stage == 0


def test_even_stage_layers_is_megatrons_split():
    assert even_stage_layers(96, 16) == [[6 * i, 6 * i + 6] for i in range(16)]
    assert even_stage_layers(7, 3) == [[0, 3], [3, 5], [5, 7]]  # the first L % p get one more
    assert even_stage_layers(8, 2, 2) == [[0, 2], [2, 4], [4, 6], [6, 8]]
    with pytest.raises(ValueError, match="do not split into 6 equal chunks"):
        even_stage_layers(8, 3, 2)
    with pytest.raises(ValueError, match="choose pp <= the layer count"):
        even_stage_layers(2, 3)


def test_evaluate_sequence_parallel_as_the_layout_says(small_tp2):
    model, cluster, plan = small_tp2
    assert not plan.sequence_parallel
    sp = autopar.evaluate(model, cluster, autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=1,
                                                         sequence_parallel=True),
                          global_batch_size=4, seq_len=64)
    assert sp.sequence_parallel and sp.placements["transformer_h_0_ln_1"] == "sharded:S1"
    assert sp.placements["transformer_h_0_attn_c_proj"] == "row:P"
    assert sp.predicted.comm_bytes_by_kind["tp_reduce_scatter"] > 0


def test_evaluate_that_does_not_fit_names_the_stage_and_its_bytes():
    """gpt-1.3b, b = 8, no recompute: about 24 · 2048 · 8 · 2048 · 194 bytes ≈ 146 GiB of
    activations (Korthikanti et al. 2022, Table 2) on an 80 GiB A100."""
    model, cluster = _meta("gpt-1.3b"), autopar.Cluster.dgx_a100(nodes=1)
    with pytest.raises(autopar.InfeasibleError,
                       match=r"tp=1,pp=1,dp=8,mbs=8.* does not fit: memory\[stage 0\] needs "
                             r"[\d.]+ GiB per GPU \(.*activations [\d.]+ GiB\) \+ a reserve of [\d.]+ GiB > 80 GiB.*"
                             r"recompute=full"):
        autopar.evaluate(model, cluster, autopar.Layout.parse("tp=1,pp=1,dp=8,mbs=8"),
                         global_batch_size=64, seq_len=2048)


def test_evaluate_refuses_a_layout_that_breaks_the_pipeline_rule():
    with pytest.raises(ValueError, match=r"interleaved 1F1B.*divisible|num_micro_batches"):
        autopar.evaluate(_meta("gpt-small-test"), autopar.Cluster.local_cpu(processes=2),
                         autopar.Layout.parse("tp=1,pp=2,dp=1,mbs=1,v=2"),
                         global_batch_size=3, seq_len=64)


def test_old_plan_without_phases_still_reads(small_tp2):
    data = small_tp2[2].to_dict()
    del data["predicted"]["stage_phase_s"]
    plan = autopar.Plan.from_dict(data)
    assert plan.predicted.stage_phase_s == []
    assert dataclasses.replace(plan, predicted=small_tp2[2].predicted) == small_tp2[2]
