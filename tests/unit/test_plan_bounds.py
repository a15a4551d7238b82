"""Kept tensors are priced at the version kept, and the search's pruning bounds hold.

* A consumer that keeps its input for backward (a LayerNorm, a Linear) keeps the version
  it reads: whole when replicated (all-gathered from a shard if need be), 1/t when a shard
  or a slice; the edge's ``saved_bytes`` says which, and a section pays for each once.
* :mod:`autopar.planner.search.bounds`: the step bound (recompute forced by memory, exposed DP,
  optimizer, sends) never exceeds the optimum CP-SAT finds for a config, and says "does
  not fit" (inf) only where CP-SAT finds no plan; its memory is the device's less the
  reserve (:mod:`autopar.planner.costs.reserve`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.graph.annotate import saves_inputs
from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.planner.search.bounds import compute_bound_s, layer_pieces, step_bound_s
from autopar.planner.costs.tables import Config, cost_tables
from autopar.planner.search.layer_bounds import min_layer_kept_bytes, min_layer_time_s
from autopar.planner.costs.decision import decision_from_plan
from autopar.planner.costs.predict import predict, section_cost
from autopar.planner.search import SearchContext, solve_one
from autopar.planner.strategies import node_strategies, tensor_inputs
from autopar.contract.support import RUNTIME_SUPPORT
from cost_models.hardware import Cluster
from cost_models.reserve import MemoryReserve
from helpers import fast_cluster

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=64, block_size=16)


def _traced():
    with torch.device("meta"):
        return trace_model(GPT(CONFIG), 16, name="gpt")


def test_kept_versions_are_priced_on_edges_whole_or_sharded():
    """Every edge into a consumer that keeps its input carries the bytes of the version it
    keeps: whole when it reads the tensor replicated (all-gathered from a shard if need
    be), 1/t when it reads a shard; a layer pays for each version once, its input included."""
    traced = _traced()
    with torch.device("meta"):
        model = GPT(CONFIG)
    plan = autopar.plan(model, fast_cluster(2), global_batch_size=4, seq_len=16,
                        layout=autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=2,
                                              recompute="none"))
    decision, tables, strategies = decision_from_plan(traced, fast_cluster(2), plan)
    choice, layer = decision.strategy, traced.layers[1]
    graph = {n.name: n for n in traced.gm.graph.nodes}
    kept, gathered = {}, 0
    for v in layer:
        strat = strategies[v][choice[v]]
        for j, u in enumerate(tensor_inputs(graph[v], traced.nodes)):
            edge = tables.edge[(u.name, v, j)][(choice[u.name], choice[v])]
            if not saves_inputs(traced.nodes[v]):
                assert edge.saved_bytes == 0
                continue
            whole = not strat.inputs[j].is_sharded
            assert edge.saved_bytes == pytest.approx(edge.nbytes / (1 if whole else 2))
            gathered += edge.fwd_kind == "all_gather"
            kept[(u.name, strat.inputs[j])] = edge.saved_bytes
    assert gathered, "the fast-link plan all-gathers a sharded tensor into a saver"
    own = sum(tables.node[n][choice[n]].saved_bytes for n in layer)
    cost = section_cost(traced, strategies, tables, choice, layer)
    assert cost["act_bytes"] == pytest.approx(own + sum(kept.values()))


CONFIGS = [(2, 2, 2, 1, 4, "1f1b", 1), (1, 4, 2, 1, 4, "1f1b", 1),
           (2, 2, 2, 1, 4, "interleaved_1f1b", 2), (4, 2, 1, 2, 4, "gpipe", 1),
           (1, 2, 4, 2, 2, "1f1b", 1), (1, 3, 2, 1, 4, "1f1b", 1),
           (2, 2, 2, 1, 4, "1f1b", 1, "fp32", "math", True),  # 4 layers on 3 ranks; SP
           (1, 4, 2, 1, 4, "zb_h1", 1), (2, 2, 2, 1, 4, "zb_v", 2),  # W's in the bubble;
           (1, 2, 4, 1, 4, "dualpipe_v", 2)]                           # priced by the order


def _config(fields: tuple) -> Config:
    """A Config of ``fields``, in fp32 unless they name the dtype."""
    return Config(*fields) if len(fields) > 7 else Config(*fields, "fp32")


def _bound_and_step(traced, cluster, cfg: Config):
    """(step bound as the search computes it, with the layer's least time and least kept
    bytes over whole strategy choices; predicted step of CP-SAT's optimum or None; CP-SAT
    status)."""
    strategies = node_strategies(traced, cfg.tp, cfg.sequence_parallel)
    tables = cost_tables(traced, strategies, cluster, cfg)
    layer_s = min_layer_time_s(traced, strategies, tables, cluster)
    pieces = layer_pieces(traced, tables, min_layer_kept_bytes(traced, strategies, tables, cluster))
    bound = step_bound_s(traced, tables, cfg, layer_s, cluster,
                         RUNTIME_SUPPORT.zero_stages_for(cfg.pp), RUNTIME_SUPPORT.recompute,
                         pieces)
    decision, status, tables, strategies = solve_one(
        SearchContext.of(traced, cluster, autopar.Layout(), RUNTIME_SUPPORT), cfg,
        time_limit_s=5.0)
    if decision is None:
        return bound, None, status
    step = predict(traced, strategies, tables, cluster, decision,
                   global_batch_size=cfg.dp * cfg.micro_batch_size * cfg.num_micro_batches)
    return bound, step.step_time_s, status


def test_step_bound_holds_against_cp_sat():
    """Memory from free (8 GiB) to binding (recompute chosen) to too small for some configs:
    the bound never exceeds the optimum's predicted step time, is inf only where CP-SAT
    finds no plan, and grows once memory forces recompute."""
    traced, base = _traced(), Cluster.local_cpu(processes=8)
    free = {}
    grew = False
    for gib in (8.0, 0.0006, 0.0004, 0.0003):
        cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_gib=gib),
                                      memory_reserve=MemoryReserve.none())
        for fields in CONFIGS:
            cfg = _config(fields)
            bound, step, status = _bound_and_step(traced, cluster, cfg)
            free.setdefault(fields, bound)
            grew |= bound > free[fields] * (1 + 1e-6)
            if step is None:
                assert status == "INFEASIBLE", (gib, cfg, status)
            else:
                assert status == "OPTIMAL" and bound <= step * (1 + 1e-9), (gib, cfg, bound, step)
            assert bound < float("inf") or step is None, (gib, cfg)
    assert grew, "binding memory raises the bound of some config above its memory-free value"


def test_step_bound_reads_memory_less_the_reserve():
    """The bound compares rank 0's memory with the device less the reserve
    (:func:`~autopar.planner.costs.reserve.usable_bytes`): a 1 GiB context on a device 1 GiB
    larger gives the bound of the smaller device without a reserve, above the bound of the
    larger device without one where memory binds."""
    traced, base = _traced(), Cluster.local_cpu(processes=8)
    context = MemoryReserve(1.0, 0.0, 0, 0, "a 1 GiB context only", False)

    def bound(gib: float, reserve: MemoryReserve) -> float:
        cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_gib=gib),
                                      memory_reserve=reserve)
        cfg = Config(*CONFIGS[1], "fp32")  # memory binds at 0.0003 GiB
        strategies = node_strategies(traced, cfg.tp)
        tables = cost_tables(traced, strategies, cluster, cfg)
        layer_s = min_layer_time_s(traced, strategies, tables, cluster)
        return step_bound_s(traced, tables, cfg, layer_s, cluster,
                            RUNTIME_SUPPORT.zero_stages_for(cfg.pp), RUNTIME_SUPPORT.recompute)

    small = bound(0.0003, MemoryReserve.none())
    assert bound(1.0003, context) == pytest.approx(small, rel=1e-9)
    assert bound(1.0003, MemoryReserve.none()) < small


def test_compute_bound_counts_the_largest_rank_whole():
    """Some rank holds ceil(L/p) layers: 4 layers on 3 ranks with m = 4 cost at least
    (m - 1)·2ℓ + 4ℓ = 10ℓ (the fractional (m + p - 1)·(L/p)·ℓ says 8ℓ); interleaved with
    v = 2 on 2 ranks, (m - 1/2)·2ℓ + 4ℓ/2 = 9ℓ, the balanced (m + (p-1)/v)·(L/p)·ℓ."""
    traced = _traced()
    assert compute_bound_s(traced, _config(CONFIGS[5]), 0.5) == pytest.approx(10 * 0.5)
    assert compute_bound_s(traced, _config(CONFIGS[2]), 0.5) == pytest.approx(9 * 0.5)


@pytest.mark.parametrize("fields", [CONFIGS[0], CONFIGS[6]])
def test_layer_kept_bytes_bound_whole_choices(fields):
    """The least kept bytes of a layer over whole strategy choices (without and with
    selective recompute) lie between the sum of each node's own least and what CP-SAT's
    plan of the config keeps per layer."""
    traced, cluster, cfg = _traced(), Cluster.local_cpu(processes=8), _config(fields)
    strategies = node_strategies(traced, cfg.tp, cfg.sequence_parallel)
    tables = cost_tables(traced, strategies, cluster, cfg)
    act, sel = min_layer_kept_bytes(traced, strategies, tables, cluster)
    per_node = layer_pieces(traced, tables)
    assert per_node.act <= act * (1 + 1e-9) and per_node.sel <= sel * (1 + 1e-9)
    decision, status, tables, strategies = solve_one(
        SearchContext.of(traced, cluster, autopar.Layout(), RUNTIME_SUPPORT), cfg,
        time_limit_s=5.0)
    assert status == "OPTIMAL"
    cost = section_cost(traced, strategies, tables, decision.strategy, traced.layers[0])
    assert 0 < act <= cost["act_bytes"] * (1 + 1e-9)
    assert 0 < sel <= (cost["act_bytes"] - cost["core_act_bytes"]) * (1 + 1e-9)
