"""Price a fully decided plan: the :class:`~autopar.plan.Prediction` of a Decision.

Walks the real graph (every layer, not a template) with the same
:class:`~autopar.cost.CostTables` the solver used, so ``evaluate`` of a hand layout, the
solver's chosen plan and the report agree, and the solver's objective can be checked
against this independent sum (tests do).
"""

from __future__ import annotations

from collections import defaultdict

from cost_models import compute
from cost_models.memory import in_flight_micro_batches
from cost_models.pipeline import pipeline_step_time_s

from .cost import (OPTIMIZER_BYTES_PER_PARAM, CostTables, bytes_per_param,
                   dp_comm_s_per_param)
from .graph import TracedModel
from .plan import Prediction
from .strategies import NodeStrategies, tensor_inputs

__all__ = ["section_cost", "predict"]


def section_cost(traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                 choice: dict[str, int], names: list[str]) -> dict[str, float]:
    """Sum one micro-batch's costs over ``names`` (a layer, pre or post).

    Keys: fwd_s/bwd_s (compute), tp_fwd_s/tp_bwd_s (TP comm), core_fwd_s, act_bytes,
    core_act_bytes, params, and comm bytes "tp_all_reduce" / "tp_all_gather".
    """
    out: dict[str, float] = defaultdict(float)
    nodes, members = traced.nodes, set(names)
    partial: set[str] = set()
    for node in traced.gm.graph.nodes:
        if node.name not in members:
            continue
        k = choice[node.name]
        c = tables.node[node.name][k]
        out["fwd_s"] += c.fwd_s
        out["bwd_s"] += c.bwd_s
        out["core_fwd_s"] += c.core_fwd_s
        out["act_bytes"] += c.saved_bytes
        out["core_act_bytes"] += c.core_saved_bytes
        out["params"] += c.param_numel
        strat = strategies[node.name][k]
        for j, src in enumerate(tensor_inputs(node, nodes)):
            edge = tables.edge[(src.name, node.name, j)][(choice[src.name], k)]
            if edge is None:
                raise ValueError(f"plan reshards {src.name} -> {node.name} in a way autopar "
                                 "does not offer; the placements are inconsistent")
            out["tp_fwd_s"] += edge.fwd_s
            out["tp_bwd_s"] += edge.bwd_s
            for kind in (edge.fwd_kind, edge.bwd_kind):
                if kind:
                    out[f"tp_{kind}"] += edge.nbytes
            if strat.partial_grad_inputs and strat.partial_grad_inputs[j]:
                partial.add(src.name)
    for u in partial:  # Megatron f: one backward all-reduce per partially-consumed tensor
        out["tp_bwd_s"] += tables.f_s[u]
        out["tp_all_reduce"] += tables.f_bytes[u] if tables.config.tp > 1 else 0.0
    return out


def _stage(traced, strategies, tables, choice, bounds, recompute, i, p):
    """One stage's summed costs, recompute seconds, kept activations (per micro-batch in
    flight) and extra activations held once (the layer being run, the loss)."""
    total: dict[str, float] = defaultdict(float)
    rec_s = act = extra_act = 0.0
    for l in range(*bounds):
        layer = section_cost(traced, strategies, tables, choice, traced.layers[l])
        for key, val in layer.items():
            total[key] += val
        mode = recompute[l]
        if mode == "full":
            rec_s += layer["fwd_s"] + layer["tp_fwd_s"]
            act += tables.full_ckpt_bytes
        elif mode == "selective":
            rec_s += layer["core_fwd_s"]
            act += layer["act_bytes"] - layer["core_act_bytes"]
        else:
            act += layer["act_bytes"]
        extra_act = max(extra_act, layer["act_bytes"])  # working set of the running layer
    for sec, on in (("pre", i == 0), ("post", i == p - 1)):
        if on:
            s = section_cost(traced, strategies, tables, choice, getattr(traced, sec))
            for key, val in s.items():
                total[key] += val
            if sec == "pre":
                act += s["act_bytes"]
            else:
                extra_act += s["act_bytes"] + tables.loss_bytes
                total["fwd_s"] += tables.loss_s / 3
                total["bwd_s"] += 2 * tables.loss_s / 3
    if p == 1:  # the tied weight is one tensor when both ends share a stage
        total["params"] -= _tied_numel(traced, tables, choice)
    return total, rec_s, act, extra_act


def _tied_numel(traced, tables, choice) -> float:
    from .strategies import tied_groups

    return sum(tables.node[g[-1]][choice[g[-1]]].param_numel for g in tied_groups(traced)
               if g[-1] in traced.post)


def predict(traced: TracedModel, strategies: NodeStrategies, tables: CostTables, cluster,
            decision, *, global_batch_size: int) -> Prediction:
    """Predicted step time, throughput and per-stage memory of a decided plan."""
    cfg = tables.config
    p, m, d = cfg.pp, cfg.num_micro_batches, cfg.dp
    stage_t, mem, parts = [], [], []
    for i, bounds in enumerate(decision.stage_layers):
        total, rec_s, act, extra = _stage(traced, strategies, tables, decision.strategy,
                                          bounds, decision.recompute, i, p)
        t = total["fwd_s"] + total["bwd_s"] + total["tp_fwd_s"] + total["tp_bwd_s"] + rec_s
        stage_t.append(t)
        inflight = in_flight_micro_batches(cfg.schedule, p, i, m, cfg.virtual_stages)
        params = total["params"]
        bpp = bytes_per_param(decision.zero_stage, d)
        zero = decision.zero_stage
        mem.append({
            "parameters": params * 2.0 / (d if zero >= 3 else 1),
            "gradients": params * 2.0 / (d if zero >= 2 else 1),
            "optimizer_states": params * (bpp - 2.0 / (d if zero >= 3 else 1) - 2.0 / (d if zero >= 2 else 1)),
            "activations": act * int(-(-inflight // 1)) + extra,
        })
        parts.append((total, rec_s, params))
    pipe = pipeline_step_time_s(stage_t, m, cfg.schedule, cfg.virtual_stages, tables.p2p_s)
    dp_s = max(dp_comm_s_per_param(decision.zero_stage, cluster, cfg) * pt[2] for pt in parts)
    opt_s = max(compute.memory_bound_time_s(OPTIMIZER_BYTES_PER_PARAM * pt[2]
                                            / (d if decision.zero_stage else 1), cluster.device)
                for pt in parts)
    step = pipe + dp_s
    slow = max(range(p), key=lambda i: stage_t[i])
    total, rec_s, params = parts[slow]
    breakdown = {
        "compute": m * (total["fwd_s"] + total["bwd_s"]), "recompute": m * rec_s,
        "tp_comm": m * (total["tp_fwd_s"] + total["tp_bwd_s"]),
        "pp_p2p": m * tables.p2p_s if p > 1 else 0.0, "dp_comm": dp_s, "optimizer": opt_s,
    }
    breakdown["bubble"] = max(0.0, pipe - m * (stage_t[slow] + (tables.p2p_s if p > 1 else 0.0)))
    comm = {k: m * v for k, v in total.items() if k.startswith("tp_all")}
    comm["pp_p2p"] = 2 * m * tables.p2p_bytes if p > 1 else 0.0
    comm["dp_all_reduce"] = 2.0 * params if d > 1 else 0.0
    n = cfg.tp * p * d
    model_flops = tables.model_flops_per_seq * global_batch_size
    rec_flops = global_batch_size * sum(
        tables.layer_fwd_flops_per_seq if r == "full" else
        (_sdpa_flops(traced) if r == "selective" else 0.0) for r in decision.recompute)
    peak = cluster.device.peak_flops
    step_total = step + opt_s
    return Prediction(
        step_time_s=step_total,
        tflops_per_gpu=(model_flops + rec_flops) / step_total / n / 1e12,
        mfu=model_flops / step_total / n / peak, hfu=(model_flops + rec_flops) / step_total / n / peak,
        peak_memory_bytes=max(sum(s.values()) for s in mem), memory_bytes_by_stage=mem,
        time_s_by_kind=breakdown, comm_bytes_by_kind=comm, stage_time_s=stage_t,
        solve_time_s=decision.solve_time_s)


def _sdpa_flops(traced: TracedModel) -> float:
    return sum(traced.nodes[n].flops for n in traced.layers[0] if traced.nodes[n].kind == "sdpa")
