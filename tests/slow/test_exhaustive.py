"""The CP-SAT search against an exhaustive check of the same plan space (autopar.oracle.exhaustive).

Ladder: (1) the dynamic programme over TP assignments loses no assignment (naive
enumeration of a small model, each priced by predict.section_cost); (2) the fast stage
pricing equals predict on random plans; (3) on a small model the exhaustive optimum equals
a brute force over every whole plan priced by predict; (4) autopar's CP-SAT plan has the
exhaustive optimum's predicted step time within 0.1% on GPTs of 2-4 layers, h 64-256,
N <= 16, with and without binding memory (larger cases: benchmarks/exhaustive_vs_cpsat.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.contract.placement import REPLICATE
from autopar.planner.costs.tables import cost_tables
from autopar.oracle.exhaustive import (StagePlan, config_options, decision_of, exhaustive,
                                       exhaustive_search, price, replicated_index, stage_splits,
                                       ties_agree)
from autopar.models import GPT, GPTConfig
from autopar.planner.costs.predict import predict, section_cost
from autopar.contract.support import FULL_SPACE, RuntimeSupport
from autopar.planner.search import candidate_configs
from autopar.planner.costs.decision import Decision
from autopar.planner.cpsat.terms import template_map
from autopar.planner.strategies import (node_strategies, param_split, reshard_kinds, tensor_inputs,
                                tied_groups)
from autopar.graph.capture import trace_model
from cost_models.hardware import Cluster
from cost_models.reserve import MemoryReserve

WITH_ZERO = RuntimeSupport(zero_stages=(0, 1, 2, 3))


class _Block(nn.Module):
    """A gated MLP block: a tensor read twice (reshard and f shared), a residual."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.up, self.gate, self.down = nn.Linear(h, 2 * h), nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        self.act, self.drop = nn.GELU(), nn.Dropout(0.1)

    def forward(self, x):  # x: (b, s, h)
        y = self.ln(x)
        return x + self.drop(self.down(self.act(self.up(y) + self.gate(y))))


class _TinyLM(nn.Module):
    """Tied embedding / head around two blocks: small enough to enumerate every plan."""

    def __init__(self, vocab: int = 8, h: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.drop = nn.Embedding(vocab, h), nn.Dropout(0.1)
        self.h = nn.ModuleList(_Block(h) for _ in range(layers))
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):  # idx: (b, s) -> logits (b, s, V)
        x = self.drop(self.wte(idx))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


def _meta(cfg) -> nn.Module:
    with torch.device("meta"):
        return GPT(cfg) if isinstance(cfg, GPTConfig) else _TinyLM()


def _memory(cluster: Cluster, gib: float) -> Cluster:
    """``cluster`` with ``gib`` of device memory and no reserve (KiB-sized problems)."""
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_gib=gib),
                               memory_reserve=MemoryReserve.none())


def _assignments(traced, strategies, names, boundary):
    """Every strategy assignment of ``names`` whose transitions are offered (naive DFS)."""
    graph = {n.name: n for n in traced.gm.graph.nodes}
    ins = {v: [u.name for u in tensor_inputs(graph[v], traced.nodes)] for v in names}
    out = {boundary: REPLICATE} if boundary else {}

    def walk(i, chosen):
        if i == len(names):
            yield dict(chosen)
            return
        v = names[i]
        for k, s in enumerate(strategies[v]):
            outs = {**out, **{n: strategies[n][c].output for n, c in chosen.items()}}
            if all(reshard_kinds(outs[u], s.inputs[j]) is not None for j, u in enumerate(ins[v])):
                yield from walk(i + 1, {**chosen, v: k})
    yield from walk(0, {})


def _vector(traced, strategies, tables, choice, names) -> tuple:
    """The first seven FIELDS and bwd_s of one assignment, from predict.section_cost."""
    c = section_cost(traced, strategies, tables, choice, names)
    tied = sum(tables.node[g[-1]][choice[g[-1]]].param_numel for g in tied_groups(traced)
               if g[-1] in names and g[-1] in traced.post)
    return (c["fwd_s"] + c["bwd_s"] + c["tp_fwd_s"] + c["tp_bwd_s"], c["rec_fwd_s"],
            c["core_fwd_s"], c["act_bytes"], c["act_bytes"] - c["core_act_bytes"],
            c["params"], c["params"] - tied, c["bwd_s"] + c["tp_bwd_s"])


def test_pareto_options_cover_every_tp_assignment():
    traced = trace_model(_meta(None), 3)
    cluster = Cluster.local_cpu(2)
    cfg = candidate_configs(traced, cluster, 2, autopar.Layout(tp=2, micro_batch_size=1))[0]
    strategies = node_strategies(traced, 2)
    tables = cost_tables(traced, strategies, cluster, cfg)
    boundaries = (traced.pre[-1], traced.layers[-1][-1])
    r_out = {n: replicated_index(strategies, n) for n in boundaries}  # the replicated layer inputs
    sections = [(traced.pre, None, True), (traced.layers[0], boundaries[0], True),
                (traced.post, boundaries[1], False)]
    for (names, boundary, replicated), options in zip(
            sections, config_options(traced, strategies, tables)):
        for o in options:  # each option is a real assignment, priced as predict prices it
            vec = _vector(traced, strategies, tables, {**r_out, **o.choice}, names)
            assert vec == pytest.approx(o.vec[:7] + (o["bwd_s"],), rel=1e-12), names
        count = 0
        for choice in _assignments(traced, strategies, names, boundary):
            if replicated and strategies[names[-1]][choice[names[-1]]].output != REPLICATE:
                continue
            count += 1
            vec = _vector(traced, strategies, tables, {**r_out, **choice}, names)
            ties = {(n, s) for n, s in _split(traced, strategies, choice)}
            assert any(set(o.ties) == ties and _no_worse(o.vec[:7] + (o["bwd_s"],), vec)
                       for o in options), choice
        assert count >= len(options) and (len(names) < 5 or count > 20), (names, count)


def _no_worse(a: tuple, b: tuple) -> bool:
    """a is no worse than b where the step time grows: (time - bwd, ..., bwd)."""
    key = lambda v: (v[0] - v[7],) + v[1:]  # noqa: E731
    return all(x <= y + 1e-12 * abs(y) for x, y in zip(key(a), key(b)))


def _split(traced, strategies, choice):
    return [(n, param_split(strategies[n][k])) for n, k in choice.items()
            if any(n in g for g in tied_groups(traced))]


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_fast_pricing_equals_predict_on_random_plans(attention):
    traced = trace_model(_meta(GPTConfig(6, 8, 256, 512, 128)), 128)
    cluster = dataclasses.replace(Cluster.dgx_a100(1), attention=attention)
    rng, groups = random.Random(0), tied_groups(traced)
    configs = candidate_configs(traced, cluster, 16, autopar.Layout(), FULL_SPACE)
    for _ in range(40):
        cfg = rng.choice(configs)
        strategies = node_strategies(traced, cfg.tp)
        tables = cost_tables(traced, strategies, cluster, cfg)
        options = config_options(traced, strategies, tables)
        secs = rng.choice([s for s in itertools.product(*options) if ties_agree(*s, groups=groups)])
        stages = []
        for n in rng.choice(stage_splits(traced.num_layers, cfg.pp)):
            full = rng.randint(0, n)
            stages.append(StagePlan(n, full, rng.randint(0, n - full)))
        zero = rng.choice((0, 1, 2, 3))
        step, mem, _ = price(secs, tables, cluster, cfg, stages, zero)
        pred = predict(traced, strategies, tables, cluster,
                       decision_of(traced, cfg, secs, stages, zero, step, 0.0), global_batch_size=16)
        assert step == pytest.approx(pred.step_time_s, rel=1e-12)
        assert mem == pytest.approx([sum(m.values()) for m in pred.memory_bytes_by_stage], rel=1e-12)


def _brute_force(traced, cluster, batch, support):
    """(step time, peak bytes) of every whole plan, each priced by predict."""
    out = []
    for cfg in candidate_configs(traced, cluster, batch, autopar.Layout(), support):
        strategies = node_strategies(traced, cfg.tp)
        tables = cost_tables(traced, strategies, cluster, cfg)
        pre = [c for c in _assignments(traced, strategies, traced.pre, None)
               if strategies[traced.pre[-1]][c[traced.pre[-1]]].output == REPLICATE]
        layer = [c for c in _assignments(traced, strategies, traced.layers[0], traced.pre[-1])
                 if strategies[traced.layers[0][-1]][c[traced.layers[0][-1]]].output == REPLICATE]
        post = list(_assignments(traced, strategies, traced.post, traced.layers[-1][-1]))
        for a, b, c in itertools.product(pre, layer, post):
            if len({s for _, s in _split(traced, strategies, {**a, **c})}) > 1:
                continue
            chosen = {**a, **b, **c}
            strategy = {n: chosen[t] for n, t in template_map(traced).items()}
            for split in stage_splits(traced.num_layers, cfg.pp):
                bounds = [[sum(split[:i]), sum(split[:i + 1])] for i in range(len(split))]
                for modes in itertools.product(*[_stage_modes(n) for n in split]):
                    for zero in support.zero_stages:
                        d = Decision(cfg, strategy, bounds, sum(modes, []), zero, 0, 0)
                        p = predict(traced, strategies, tables, cluster, d, global_batch_size=batch)
                        peak = max(sum(m.values()) for m in p.memory_bytes_by_stage)
                        out.append((p.step_time_s, peak))
    return out


def _stage_modes(n: int) -> list[list[str]]:
    return [["full"] * f + ["selective"] * s + ["none"] * (n - f - s)
            for f in range(n + 1) for s in range(n - f + 1)]


def test_exhaustive_equals_brute_force_over_whole_plans():
    traced = trace_model(_meta(None), 3)
    cluster = Cluster.local_cpu(2)
    support = RuntimeSupport(zero_stages=(0, 1))
    plans = _brute_force(traced, cluster, 2, support)
    assert len(plans) > 1000
    peaks = sorted(p for _, p in plans)
    for limit in (peaks[-1], peaks[len(peaks) // 3]):  # memory free, then binding
        small = _memory(cluster, limit / 2**30)
        want = min(t for t, p in plans if p <= small.device.memory_bytes)
        got = exhaustive_search(traced, small, 2, autopar.Layout(), support)
        assert got.step_time_s == pytest.approx(want, rel=1e-12)


# (model, cluster, global batch, seq_len, memory GiB or None): N <= 16, L 2-4, h 64-256.
# The 6- and 8-layer, h 512-1024 cases (up to 10 minutes each on 2 cores) and the 8-process
# CPU ones (4 layers, h 256: 2.5 minutes since the search tries the V schedules, each plan
# priced by simulating its order) are benchmarks/exhaustive_vs_cpsat.py's, which exits 1 on
# a gap above 0.1%.
_FLASH_CPU2 = dataclasses.replace(Cluster.local_cpu(2), attention="flash")
CASES = {
    "cpu2-L2-h64": (GPTConfig(2, 4, 64, 256, 64), Cluster.local_cpu(2), 8, 64, None),
    # microsecond-scale steps (issue 13 measured a +9.4% gap here: mbs 2 chosen over mbs 4)
    "a100x16-L2-h64": (GPTConfig(2, 4, 64, 256, 64), Cluster.dgx_a100(2), 16, 64, None),
    "cpu4-L4-h256-recompute": (GPTConfig(4, 8, 256, 512, 256), Cluster.local_cpu(4), 16, 256, 0.02),
    # flash attention (the kernel keeps its output and log-sum-exp), memory binding
    "cpu2-L2-h64-flash-recompute": (GPTConfig(2, 4, 64, 256, 64), _FLASH_CPU2, 8, 64, 0.004),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cpsat_plan_is_the_exhaustive_optimum(name):
    cfg, cluster, batch, seq, gib = CASES[name]
    cluster = _memory(cluster, gib) if gib else cluster
    model = _meta(cfg)
    auto = autopar.plan(model, cluster, global_batch_size=batch, seq_len=seq)
    best = exhaustive(model, cluster, global_batch_size=batch, seq_len=seq, rounding="solver")
    exact = exhaustive_search(trace_model(model, seq), cluster, batch, rounding="predict")
    assert best.predicted.step_time_s <= auto.predicted.step_time_s * (1 + 1e-9)
    assert auto.predicted.step_time_s == pytest.approx(best.predicted.step_time_s, rel=1e-3)
    assert exact.step_time_s <= best.predicted.step_time_s * (1 + 1e-9)  # rounding only removes
    if gib:
        assert set(auto.recompute) != {"none"}, "memory should bind in this case"


# With every ZeRO stage allowed (the cost model prices all four even though the runtime
# executes stage 0 today), the solver must still find the optimum: this caught the missing
# optimizer-step term in the objective, which made ZeRO-1 merely tie with ZeRO-0.
ZERO_CASES = {
    "zero-allowed": (GPTConfig(4, 8, 256, 512, 128), Cluster.dgx_a100(1), 16, 128, WITH_ZERO),
}


@pytest.mark.parametrize("name", list(ZERO_CASES))
def test_cpsat_is_optimal_with_every_zero_stage(name):
    from autopar.api import plan_from_search
    from autopar.planner.search import search

    cfg, cluster, batch, seq, support = ZERO_CASES[name]
    model = _meta(cfg)
    traced = trace_model(model, seq)
    result = search(traced, cluster, batch, autopar.Layout(), support)
    auto = plan_from_search(traced, model, cluster, result, global_batch_size=batch, seq_len=seq,
                            model_name="m")
    best = exhaustive_search(traced, cluster, batch, support=support, rounding="solver")
    assert auto.predicted.step_time_s == pytest.approx(best.step_time_s, rel=1e-3)
