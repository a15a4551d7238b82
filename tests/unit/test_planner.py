"""Planner regimes, published reference points, plan round trip and clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.models import GPT, preset
from autopar.planner.search import SearchContext, solve_one
from autopar.contract.support import FULL_SPACE
from autopar.graph.capture import trace_model


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return GPT(preset(name))


def test_small_model_is_not_split():
    plan = autopar.plan(_meta("gpt-tiny"), autopar.Cluster.local_cpu(processes=4),
                        global_batch_size=8, seq_len=16)
    # the model is never split: no pipeline, no TP collective. gpt-tiny's step is latency
    # bound, so a DP ring of 2 whose TP pairs compute the same batch (tp 2, replicated) may
    # beat a ring of 4 by the ring steps and the first bucket's latency it saves
    assert plan.pp == 1 and plan.tp * plan.dp == 4
    comm = plan.predicted.comm_bytes_by_kind
    assert all(comm[k] == 0 for k in comm if k.startswith("tp_")), comm
    assert plan.predicted.time_s_by_kind.get("tp_comm", 0.0) == 0.0


@pytest.fixture(scope="module")
def tp8_plan():
    return autopar.plan(_meta("gpt-8.3b"), autopar.Cluster.dgx_a100(nodes=1), global_batch_size=16,
                        seq_len=1024, layout=autopar.Layout(tp=8, pp=1, dp=1, sequence_parallel=False))


def test_solver_rediscovers_megatron_tensor_parallel_pattern(tp8_plan):
    p = tp8_plan.placements
    for proj in ("attn_c_q", "attn_c_k", "attn_c_v", "mlp_c_fc"):
        assert p[f"transformer_h_0_{proj}"] == "column:S2", proj
    assert p["transformer_h_0_attn_c_proj"] == "row:P"
    assert p["transformer_h_0_mlp_c_proj"] == "row:P"
    assert p["scaled_dot_product_attention"] == "heads:S1"
    assert p["transformer_h_0_mlp_gelu"] == "sharded:S2"
    assert p["transformer_h_0_ln_1"] == "replicate:R"
    assert p["transformer_wte"] == "vocab:P" and p["lm_head"] == "column:S2"
    assert all(p[f"transformer_h_{l}_mlp_c_proj"] == "row:P" for l in range(72))
    from autopar.planner.strategies.megatron import megatron_placements

    assert p == megatron_placements(trace_model(_meta("gpt-8.3b"), 1024), 8)


@pytest.mark.parametrize("tp", [1, 8])
def test_traced_activation_bytes_equal_korthikanti_closed_form(tp8_plan, tp):
    """Korthikanti et al. 2022, Table 2: s·b·h·(34 + 5as/h) bytes per layer at t = 1 and
    s·b·h·(10 + 24/t + 5as/(ht)) with Megatron TP, derived here from the traced graph."""
    from autopar.planner.costs.tables import Config, cost_tables
    from autopar.planner.strategies import node_strategies
    from cost_models.memory import transformer_layer_activation_bytes

    cluster = autopar.Cluster.dgx_a100(nodes=1)
    traced = trace_model(_meta("gpt-8.3b"), 1024)
    strategies = node_strategies(traced, tp)
    tables = cost_tables(traced, strategies, cluster, Config(tp, 1, 8 // tp, 1, 2))
    from autopar.planner.costs.predict import section_cost

    placements = tp8_plan.placements if tp == 8 else {}
    choice = {name: [s.key for s in options].index(placements.get(name, "replicate:R"))
              for name, options in strategies.items()}
    saved = section_cost(traced, strategies, tables, choice, traced.layers[1])["act_bytes"]
    assert saved == transformer_layer_activation_bytes(1024, 1, 3072, 32, tp=tp)


@pytest.fixture(scope="module")
def gpt13_auto():
    cluster = autopar.Cluster.dgx_a100(nodes=2)
    model = _meta("gpt-1.3b")
    return model, cluster, autopar.plan(model, cluster, global_batch_size=64, seq_len=2048)


@pytest.mark.parametrize("hand", ["tp=2,pp=1,dp=8,mbs=1", "tp=4,pp=2,dp=2,mbs=2,recompute=full",
                                  "tp=8,pp=2,dp=1,mbs=4,recompute=selective",
                                  # GPipe holds all 16 micro-batches: 80.0 of 80 GiB without
                                  # recompute, which does not fit with the memory reserve
                                  "tp=1,pp=4,dp=4,mbs=1,schedule=gpipe,recompute=selective"])
def test_auto_plan_never_slower_than_a_hand_layout(gpt13_auto, hand):
    model, cluster, auto = gpt13_auto
    manual = autopar.evaluate(model, cluster, autopar.Layout.parse(hand), global_batch_size=64,
                              seq_len=2048)
    assert auto.predicted.step_time_s <= manual.predicted.step_time_s * (1 + 1e-6), hand


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_objective_equals_independent_prediction(schedule):
    """The CP-SAT objective is the predicted step time, a split backward's deferred weight
    gradients (``w_max`` rows) included."""
    cluster = autopar.Cluster.dgx_a100(nodes=2)
    model = _meta("gpt-1.3b")
    traced = trace_model(model, 2048)
    from autopar.planner.costs.tables import Config
    from autopar.planner.costs.predict import predict

    cfg = Config(tp=4, pp=2, dp=2, micro_batch_size=1, num_micro_batches=8, schedule=schedule)
    decision, status, tables, strategies = solve_one(
        SearchContext.of(traced, cluster, autopar.Layout(), FULL_SPACE), cfg)
    pred = predict(traced, strategies, tables, cluster, decision, global_batch_size=32)
    assert status == "OPTIMAL"
    assert decision.objective_s == pytest.approx(pred.step_time_s, rel=1e-3)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, idx):
        x = self.emb(idx)
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
            x = x * 2
        return x


def test_untraceable_model_raises_trace_error_naming_the_code():
    with pytest.raises(autopar.TraceError, match=r"if x.sum\(\) > 0.*\n.*fix"):
        autopar.plan(DataDependent(), autopar.Cluster.local_cpu(processes=2),
                     global_batch_size=2, seq_len=4)


def test_infeasible_cluster_names_smallest_memory():
    with pytest.raises(autopar.InfeasibleError, match=r"needs at least [\d.]+ GiB per GPU"):
        autopar.plan(_meta("gpt3-175b"), autopar.Cluster.dgx_a100(nodes=1),
                     global_batch_size=8, seq_len=2048)


def test_heads_not_divisible_by_tp_is_a_clear_error():
    model = _meta("gpt-tiny")  # 4 heads
    with pytest.raises(ValueError, match=r"4 attention heads are not divisible by tp=3"):
        autopar.evaluate(model, autopar.Cluster.local_cpu(processes=3),
                         autopar.Layout(tp=3, pp=1, dp=1, micro_batch_size=1),
                         global_batch_size=3, seq_len=16)


def test_degrees_must_multiply_to_cluster_size():
    with pytest.raises(ValueError, match=r"make the product equal 4"):
        autopar.evaluate(_meta("gpt-tiny"), autopar.Cluster.local_cpu(processes=4),
                         autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=1),
                         global_batch_size=4, seq_len=16)


def test_cluster_fields_are_validated():
    with pytest.raises(ValueError, match="nodes"):
        autopar.Cluster.dgx_a100(nodes=0)


def test_user_model_factory_can_be_planned():
    model, name = autopar.load_model("tests_factory:tiny_gpt")
    plan = autopar.plan(model, autopar.Cluster.local_cpu(processes=2), global_batch_size=4,
                        seq_len=8, model_name=name)
    assert plan.model == "tests_factory:tiny_gpt" and plan.tp * plan.pp * plan.dp == 2


def test_sequence_parallelism_is_the_solvers_choice(tp8_plan):
    """Layout.sequence_parallel unset: the search prices both and takes SP here, since
    LayerNorm, dropout and the residual adds then run on 1/t of the sequence (Korthikanti et
    al. 2022, section 4.2.2) for the same bytes on the wire; pinned False stays False."""
    free = autopar.plan(_meta("gpt-8.3b"), autopar.Cluster.dgx_a100(nodes=1), global_batch_size=16,
                        seq_len=1024, layout=autopar.Layout(tp=8, pp=1, dp=1))
    assert free.sequence_parallel and not tp8_plan.sequence_parallel
    assert free.predicted.step_time_s < tp8_plan.predicted.step_time_s
    assert free.predicted.peak_memory_bytes < tp8_plan.predicted.peak_memory_bytes


def test_a_stopped_solve_gets_the_best_stages_for_its_strategies(monkeypatch):
    """CP-SAT stopped at its limit (FEASIBLE) leaves the pipeline cuts and recompute short of
    the best for the strategies it chose; ``polish_stages`` re-solves them with the
    strategies fixed: a strictly better plan of the same strategies, priced as predict
    prices it, and still FEASIBLE (nothing proven for the config)."""
    import autopar.planner.search.branch_and_bound as bb
    from autopar.planner.costs.predict import predict
    from autopar.planner.costs.tables import Config

    traced = trace_model(_meta("gpt-8.3b"), 2048)
    cluster = autopar.Cluster.dgx_a100(nodes=4)
    ctx = SearchContext.of(traced, cluster, autopar.Layout(), FULL_SPACE)
    cfg = Config(tp=2, pp=8, dp=2, micro_batch_size=1, num_micro_batches=16)
    polished = bb.solve_config(ctx, cfg, time_limit_s=0.02)
    monkeypatch.setattr(bb, "polish_stages", lambda *args: None)
    joint = bb.solve_config(ctx, cfg, time_limit_s=0.02)  # the same solve, not polished
    assert polished.status == joint.status == "FEASIBLE"
    assert polished.decision.strategy == joint.decision.strategy
    assert polished.decision.objective_s < joint.decision.objective_s
    pred = predict(traced, polished.strategies, polished.tables, cluster, polished.decision,
                   global_batch_size=32)
    assert polished.decision.objective_s == pytest.approx(pred.step_time_s, rel=1e-3)


def test_a_runner_up_cp_sat_finds_nothing_for_is_priced_with_the_searchs_strategies():
    """A runner-up whose joint solve finds no plan in its time (UNKNOWN) is priced with the
    strategies of the search's plan of the same key, its stages solved for them: the report
    shows a step time for it instead of none."""
    import autopar.planner.search.branch_and_bound as bb
    from autopar.planner.costs.predict import predict
    from autopar.planner.costs.tables import Config

    traced = trace_model(_meta("gpt-8.3b"), 2048)
    cluster = autopar.Cluster.dgx_a100(nodes=4)
    ctx = SearchContext.of(traced, cluster, autopar.Layout(), FULL_SPACE)
    best = bb.solve_config(ctx, Config(tp=2, pp=8, dp=2, micro_batch_size=1,
                                       num_micro_batches=16), time_limit_s=1.0)
    cfg = Config(tp=2, pp=4, dp=4, micro_batch_size=1, num_micro_batches=8)
    joint, priced = bb._runner_up(ctx, cfg, 0.003, best.decision.strategy)
    assert joint.status == "UNKNOWN" and joint.decision is None
    assert priced.decision.strategy == best.decision.strategy
    pred = predict(traced, priced.strategies, priced.tables, cluster, priced.decision,
                   global_batch_size=32)
    assert priced.decision.objective_s == pytest.approx(pred.step_time_s, rel=1e-3)
