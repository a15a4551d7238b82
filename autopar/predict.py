"""Price a fully decided plan: the :class:`~autopar.plan.Prediction` of a Decision.

Walks the real graph (every layer, not a template) with the same
:class:`~autopar.cost.CostTables` the solver used, so ``evaluate`` of a hand layout, the
solver's chosen plan and the report agree, and the solver's objective can be checked
against this independent sum (tests do).
"""

from __future__ import annotations

import math
from collections import defaultdict

from cost_models.memory import in_flight_micro_batches
from cost_models.pipeline import pipeline_step_time_s

from .cost import CostTables, dp_comm_s_per_param, optimizer_s_per_param, state_bytes
from .graph import TracedModel, last_saver_index
from .plan import COMM_KINDS, Prediction, rank_layers
from .strategies import NodeStrategies, tensor_inputs

__all__ = ["section_cost", "predict", "p2p_sends_per_micro_batch"]


def p2p_sends_per_micro_batch(pp: int, virtual_stages: int, rank: int) -> int:
    """Point-to-point sends of pipeline rank ``rank`` per micro-batch (each a (b, s, h)
    activation or its gradient). Chunk c runs on rank c % p (``Plan.stage_layers``) and
    every chunk boundary crosses to the neighbouring rank: the rank sends the forward
    output of each of its v chunks except the model's last chunk (on rank p-1) and the
    input gradient of each except chunk 0 (on rank 0): 2v - [rank = 0] - [rank = p-1]
    (v = 1: one send each way on inner stages, one on the ends). 0 when p = 1."""
    if pp == 1:
        return 0
    return 2 * virtual_stages - int(rank == 0) - int(rank == pp - 1)


def section_cost(traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                 choice: dict[str, int], names: list[str]) -> dict[str, float]:
    """Sum one micro-batch's costs over ``names`` (one layer, pre or post).

    Keys: fwd_s/bwd_s (compute), tp_fwd_s/tp_bwd_s (TP comm), core_fwd_s, rec_fwd_s (what
    full recompute re-runs, see :func:`~autopar.graph.last_saver_index`), act_bytes,
    core_act_bytes, params, and payload bytes handed to TP collectives: "tp_all_reduce"
    (the reduced tensor), "tp_all_gather" (this rank's shard), split into forward
    ("fwd_" prefix, repeated by full recompute) and backward. A reshard of one tensor into
    one placement, and Megatron's f, run once per section however many consumers read it.
    """
    out: dict[str, float] = defaultdict(float)
    nodes, members, tp = traced.nodes, set(names), tables.config.tp
    position = {n: i for i, n in enumerate(names)}
    last = last_saver_index(nodes, names)
    partial: set[str] = set()
    done: set[tuple[str, str]] = set()
    for node in traced.gm.graph.nodes:
        if node.name not in members:
            continue
        k = choice[node.name]
        c = tables.node[node.name][k]
        if position[node.name] <= last:  # full recompute re-runs this node's forward
            out["rec_fwd_s"] += c.fwd_s
        for key, val in (("fwd_s", c.fwd_s), ("bwd_s", c.bwd_s), ("core_fwd_s", c.core_fwd_s),
                         ("act_bytes", c.saved_bytes), ("core_act_bytes", c.core_saved_bytes),
                         ("params", c.param_numel)):
            out[key] += val
        strat = strategies[node.name][k]
        for j, src in enumerate(tensor_inputs(node, nodes)):
            edge = tables.edge[(src.name, node.name, j)][(choice[src.name], k)]
            if edge is None:
                raise ValueError(f"plan reshards {src.name} -> {node.name} in a way autopar "
                                 "does not offer; the placements are inconsistent")
            if strat.partial_grad_inputs and strat.partial_grad_inputs[j]:
                partial.add(src.name)
            if (src.name, strat.inputs[j]) in done or not (edge.fwd_kind or edge.bwd_kind):
                continue
            done.add((src.name, strat.inputs[j]))
            out["tp_fwd_s"] += edge.fwd_s
            out["tp_bwd_s"] += edge.bwd_s
            rerun = position.get(src.name, -1) < last  # collective placed before the last saver
            phases = [("fwd_", edge.fwd_kind), ("", edge.bwd_kind)]
            if rerun:
                out["rec_fwd_s"] += edge.fwd_s
                phases.append(("rec_fwd_", edge.fwd_kind))
            for phase, kind in phases:
                if kind == "all_reduce":
                    out[f"{phase}tp_all_reduce"] += edge.nbytes
                elif kind == "all_gather":
                    out[f"{phase}tp_all_gather"] += edge.nbytes / tp
    for u in partial:  # Megatron f: one backward all-reduce per partially-consumed tensor
        out["tp_bwd_s"] += tables.f_s[u]
        if tp > 1:
            out["tp_all_reduce"] += tables.f_bytes[u]
    return out


def _stage(traced, strategies, tables, choice, layers, recompute, i, p):
    """One stage's summed costs, recompute seconds, kept activations per micro-batch in
    flight, activations held once (the last stage's head and loss) and the working set
    of the layer being run (recomputed layers rebuild their activations)."""
    total: dict[str, float] = defaultdict(float)
    rec_s = act = held = working = 0.0
    for l in layers:
        layer = section_cost(traced, strategies, tables, choice, traced.layers[l])
        for key, val in layer.items():
            total[key] += val
        mode = recompute[l]
        if mode == "full":
            rec_s += layer["rec_fwd_s"]
            act += tables.full_ckpt_bytes
        elif mode == "selective":
            rec_s += layer["core_fwd_s"]
            act += layer["act_bytes"] - layer["core_act_bytes"]
        else:
            act += layer["act_bytes"]
        working = max(working, layer["act_bytes"])
    for sec, on in (("pre", i == 0), ("post", i == p - 1)):
        if on:
            s = section_cost(traced, strategies, tables, choice, getattr(traced, sec))
            for key, val in s.items():
                total[key] += val
            if sec == "pre":
                act += s["act_bytes"]
            else:
                held += s["act_bytes"] + tables.loss_bytes
                total["fwd_s"] += tables.loss_s / 3
                total["bwd_s"] += 2 * tables.loss_s / 3
    if p == 1:  # the tied weight is one tensor when both ends share a stage
        total["params"] -= _tied_numel(traced, tables, choice)
    return total, rec_s, act, held, working


def _tied_numel(traced, tables, choice) -> float:
    from .strategies import tied_groups

    return sum(tables.node[g[-1]][choice[g[-1]]].param_numel for g in tied_groups(traced)
               if g[-1] in traced.post)


def predict(traced: TracedModel, strategies: NodeStrategies, tables: CostTables, cluster,
            decision, *, global_batch_size: int) -> Prediction:
    """Predicted step time, throughput, per-stage memory and per-stage step statistics."""
    cfg = tables.config
    p, m = cfg.pp, cfg.num_micro_batches
    stage_t, mem, parts, stats = [], [], [], []
    for i in range(p):  # pipeline rank i runs the layers of its v chunks
        layers = rank_layers(decision.stage_layers, p, i)
        total, rec_s, act, held, working = _stage(traced, strategies, tables, decision.strategy,
                                                  layers, decision.recompute, i, p)
        stage_t.append(total["fwd_s"] + total["bwd_s"] + total["tp_fwd_s"] + total["tp_bwd_s"] + rec_s)
        inflight = in_flight_micro_batches(cfg.schedule, p, i, m, cfg.virtual_stages)
        saved = act * inflight + held  # interleaved: (chunk forwards in flight) / v
        mem.append(_memory(total["params"], saved + working, decision.zero_stage, cfg))
        parts.append((total, rec_s, total["params"]))
        stats.append(_stage_stats(traced, strategies, tables, decision, i, total, mem[-1], saved))
    pipe = pipeline_step_time_s(stage_t, m, cfg.schedule, cfg.virtual_stages, tables.p2p_s)
    # bucketed DP reduction overlaps the backward of the stage's last micro-batch
    dp_s = max(max(0.0, dp_comm_s_per_param(decision.zero_stage, cluster, cfg) * pt[2]
                   - pt[0]["bwd_s"] - pt[0]["tp_bwd_s"]) for pt in parts)
    opt_s = max(optimizer_s_per_param(decision.zero_stage, cluster, cfg) * pt[2] for pt in parts)
    step = pipe + dp_s + opt_s
    for st in stats:
        st["step_time_s"] = step
    slow = max(range(p), key=lambda i: stage_t[i])
    total, rec_s, params = parts[slow]
    hop = tables.p2p_s * cfg.virtual_stages if p > 1 else 0.0  # v boundaries per rank
    breakdown = {
        "compute": m * (total["fwd_s"] + total["bwd_s"]), "recompute": m * rec_s,
        "tp_comm": m * (total["tp_fwd_s"] + total["tp_bwd_s"]), "pp_p2p": m * hop,
        "dp_comm": dp_s, "optimizer": opt_s,
        "bubble": max(0.0, pipe - m * (stage_t[slow] + hop)),
    }
    n = cfg.tp * p * cfg.dp
    model_flops = tables.model_flops_per_seq * global_batch_size
    rec_flops = global_batch_size * sum(
        tables.layer_fwd_flops_per_seq if r == "full" else
        (_sdpa_flops(traced) if r == "selective" else 0.0) for r in decision.recompute)
    peak = cluster.device.peak_flops
    return Prediction(
        step_time_s=step, tflops_per_gpu=(model_flops + rec_flops) / step / n / 1e12,
        mfu=model_flops / step / n / peak, hfu=(model_flops + rec_flops) / step / n / peak,
        peak_memory_bytes=max(sum(s.values()) for s in mem), memory_bytes_by_stage=mem,
        time_s_by_kind=breakdown, comm_bytes_by_kind=stats[slow]["comm_bytes"],
        stage_time_s=stage_t, solve_time_s=decision.solve_time_s, stage_stats=stats)


def _memory(params: float, activations: float, zero: int, cfg) -> dict[str, float]:
    """Bytes per GPU by kind; ZeRO shards optimizer states (>=1), gradients (>=2) and
    parameters (3) over d (Rajbhandari et al. 2020, Fig. 1)."""
    pb, gb, ob = state_bytes(cfg.dtype)
    d = cfg.dp
    return {"parameters": params * pb / (d if zero >= 3 else 1),
            "gradients": params * gb / (d if zero >= 2 else 1),
            "optimizer_states": params * ob / (d if zero >= 1 else 1),
            "activations": activations}


def _stage_stats(traced, strategies, tables, decision, i: int, total, mem, saved) -> dict:
    """What stage i's ranks should measure in one step (``last_step_stats`` keys):
    payload bytes per collective kind, model-state bytes, peak saved-activation bytes."""
    cfg = tables.config
    p, m, act_b = cfg.pp, cfg.num_micro_batches, cfg.activation_bytes
    comm = dict.fromkeys(COMM_KINDS, 0.0)
    comm["tp_all_reduce"] = m * (total["tp_all_reduce"] + total["fwd_tp_all_reduce"])
    comm["tp_all_gather"] = m * (total["tp_all_gather"] + total["fwd_tp_all_gather"])
    for l in rank_layers(decision.stage_layers, p, i):  # full recompute: forward comm again
        if decision.recompute[l] == "full":
            layer = section_cost(traced, strategies, tables, decision.strategy, traced.layers[l])
            comm["tp_all_reduce"] += m * layer["rec_fwd_tp_all_reduce"]
            comm["tp_all_gather"] += m * layer["rec_fwd_tp_all_gather"]
    comm["pp_p2p"] = p2p_sends_per_micro_batch(p, cfg.virtual_stages, i) * m * tables.p2p_bytes
    param_b, grad_b, _ = state_bytes(cfg.dtype)
    comm.update(_dp_comm_bytes(total["params"], decision.zero_stage, cfg, param_b, grad_b))
    if p > 1 and i in (0, p - 1):
        comm["other"] += grad_b * _tied_numel(traced, tables, decision.strategy)
    if i == p - 1 and cfg.dp > 1:
        comm["dp_all_reduce"] += 8.0  # the step's mean loss (float64) over DP
    comm["other"] += 8.0 * (p > 1)  # ... broadcast from the last stage
    return {"comm_bytes": comm, "model_state_bytes": mem["parameters"] + mem["gradients"]
            + mem["optimizer_states"], "saved_activation_bytes": saved}


def _dp_comm_bytes(params: float, zero: int, cfg, param_b: int, grad_b: int) -> dict[str, float]:
    """DP payload bytes per step of :class:`autopar.runtime.zero.DistributedOptimizer` for a
    stage of ``params`` parameters: ZeRO-0 all-reduces the gradients; ZeRO-1 reduce-scatters
    them once (ZeRO-2 after each of the m micro-batches) over a buffer padded to a multiple
    of d, and all-gathers this rank's 1/d of the updated parameters."""
    d = cfg.dp
    if d == 1:
        return {}
    if zero == 0:
        return {"dp_all_reduce": grad_b * params}
    padded = math.ceil(round(params) / d) * d
    times = cfg.num_micro_batches if zero == 2 else 1
    return {"dp_reduce_scatter": times * grad_b * padded, "dp_all_gather": param_b * padded / d}


def _sdpa_flops(traced: TracedModel) -> float:
    return sum(traced.nodes[n].flops for n in traced.layers[0] if traced.nodes[n].kind == "sdpa")
