"""Price a fully decided plan: the :class:`~autopar.contract.plan.Prediction` of a Decision.

Walks the real graph (every layer, not a template) with the same
:class:`~autopar.planner.costs.tables.CostTables` the solver used, so ``evaluate`` of a hand layout, the
solver's chosen plan and the report agree, and the solver's objective can be checked
against this independent sum (tests do).
"""

from __future__ import annotations

from collections import defaultdict


from autopar.graph.annotate import TracedModel, last_saver_index, saves_inputs
from autopar.contract.plan import Prediction, rank_layers
from autopar.planner.costs.comm_bytes import stage_stats
from autopar.planner.costs.tables import CostTables, f_cost
from autopar.planner.costs.reserve import rank_reserve
from autopar.planner.costs.step import (counts_tied_weight_once, head_rank, model_state_bytes_by_kind, step_time_s,
                                  tied_param_numel)
from autopar.planner.strategies import NodeStrategies, gathers_for_partial_grad, partial_grad_input, tensor_inputs
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.techniques.recompute_modes import recompute_mode

__all__ = ["section_cost", "predict", "crosses_section"]


def crosses_section(traced, u: str, v: str) -> bool:
    """Is u a section's output (the embedding's, a layer's) read by another section (the
    next layer, the head)? Its kept version is then charged to the reader's section, so
    each layer pays for its input; every other kept tensor is charged to its producer's."""
    a, b = traced.nodes[u], traced.nodes[v]
    is_output = u == traced.pre[-1] or (a.layer is not None and traced.layers[a.layer][-1] == u)
    return is_output and (a.section, a.layer) != (b.section, b.layer)


def section_cost(traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                 choice: dict[str, int], names: list[str]) -> dict[str, float]:
    """Sum one micro-batch's costs over ``names`` (one layer, pre or post).

    Keys: fwd_s/bwd_s (compute; wgrad_s the weight-gradient part of bwd_s),
    tp_fwd_s/tp_bwd_s (TP comm), core_fwd_s, rec_fwd_s (what
    full recompute re-runs, see :func:`~autopar.graph.annotate.last_saver_index`), act_bytes,
    core_act_bytes, params, and payload bytes handed to TP collectives: "tp_all_reduce"
    (the reduced tensor), "tp_all_gather" (this rank's shard), split into forward
    ("fwd_" prefix, repeated by full recompute) and backward. A reshard of one tensor into
    one placement, and Megatron's f, run once per section however many consumers read it;
    so is each version of a tensor that consumers keep for backward, in act_bytes
    (:attr:`~autopar.planner.costs.tables.EdgeCost.saved_bytes`; a section pays for its
    nodes' kept outputs and for its input, :func:`_kept_outputs`).
    """
    out: dict[str, float] = defaultdict(float)
    nodes, members, tp = traced.nodes, set(names), tables.config.tp
    position = {n: i for i, n in enumerate(names)}
    last = last_saver_index(nodes, names)
    partial: set[str] = set()
    done: set[tuple[str, str]] = set()
    kept: set[tuple[str, str]] = set()
    for node in traced.gm.graph.nodes:
        if node.name not in members:
            continue
        k = choice[node.name]
        c = tables.node[node.name][k]
        if position[node.name] <= last:  # full recompute re-runs this node's forward
            out["rec_fwd_s"] += c.rec_s
            out["rec_fwd_ep_all_to_all"] += c.a2a_fwd_bytes
            out["rec_fwd_cp_all_gather"] += c.cp_fwd_bytes
        for key, val in (("fwd_s", c.fwd_s), ("bwd_s", c.bwd_s), ("wgrad_s", c.wgrad_s),
                         ("core_fwd_s", c.core_fwd_s), ("a2a_s", c.a2a_s), ("cp_s", c.cp_s),
                         ("cp_all_gather", c.cp_fwd_bytes),
                         ("cp_reduce_scatter", c.cp_bwd_bytes),
                         ("fwd_ep_all_to_all", c.a2a_fwd_bytes),
                         ("ep_all_to_all", c.a2a_bwd_bytes),
                         ("expert_params", c.expert_param_numel),
                         ("act_bytes", c.saved_bytes), ("core_act_bytes", c.core_saved_bytes),
                         ("params", c.param_numel), ("temp_bytes", c.temp_bytes)):
            out[key] += val
        if node.op == "output":  # the loss's saved softmax (a split backward frees it at B)
            out["loss_act_bytes"] += c.saved_bytes
        strat = strategies[node.name][k]
        for j, src in enumerate(tensor_inputs(node, nodes)):
            edge = tables.edge[(src.name, node.name, j)][(choice[src.name], k)]
            if edge is None:
                raise ValueError(f"plan reshards {src.name} -> {node.name} in a way autopar "
                                 "does not offer; the placements are inconsistent")
            src_placement = strategies[src.name][choice[src.name]].output
            if partial_grad_input(strat, j):
                partial.add((src.name, src_placement))
            fused = gathers_for_partial_grad(strat, j, src_placement)
            if src.name not in members and crosses_section(traced, src.name, node.name):
                _keep(out, kept, (src.name, strat.inputs[j], fused), edge.saved_bytes)
            if (src.name, strat.inputs[j], fused) in done or not (edge.fwd_kind or edge.bwd_kind):
                continue
            done.add((src.name, strat.inputs[j], fused))
            out["tp_fwd_s"] += edge.fwd_s
            out["tp_bwd_s"] += edge.bwd_s
            rerun = position.get(src.name, -1) < last  # collective placed before the last saver
            phases = [("fwd_", edge.fwd_kind), ("", edge.bwd_kind)]
            if rerun:
                out["rec_fwd_s"] += edge.fwd_s
                phases.append(("rec_fwd_", edge.fwd_kind))
            for phase, kind in phases:
                if kind in ("all_reduce", "reduce_scatter"):  # payload: the whole tensor
                    out[f"{phase}tp_{kind}"] += edge.nbytes
                elif kind == "all_gather":  # payload: this rank's shard
                    out[f"{phase}tp_all_gather"] += edge.nbytes / tp
    _kept_outputs(traced, strategies, tables, choice, names, out, kept)
    if tp > 1 and any(strategies[n][choice[n]].name == "vocab_parallel" for n in names):
        out["fwd_tp_all_reduce"] += tables.vocab_loss_bytes  # vocab-parallel cross-entropy
    for u, placement in partial:  # Megatron f: one backward collective per tensor
        kind, f_s = f_cost(tables, u, placement)
        out["tp_bwd_s"] += f_s
        if tp > 1:
            out[f"tp_{kind}"] += tables.f_bytes[u]
    return out


def _layer_costs(traced, strategies, tables, choice) -> list[dict[str, float]]:
    """:func:`section_cost` of every layer, computed once per distinct pattern: layers whose
    nodes and external inputs (the previous layer's output, side inputs of the embedding
    section) have the same strategies in the same order cost the same (equal shapes, equal
    tables), and a deep model's layers almost always do."""
    graph = {n.name: n for n in traced.gm.graph.nodes}
    seen: dict[tuple, dict[str, float]] = {}
    out = []
    for names in traced.layers:
        members = set(names)
        # what the layer's edges in read (layer 0: the pre section's outputs), not only
        # their strategy index, which an embedding and a layer's output can share
        outside = tuple((traced.nodes[u.name].section, traced.nodes[u.name].numel,
                         strategies[u.name][choice[u.name]].key)
                        for v in names for u in tensor_inputs(graph[v], traced.nodes)
                        if u.name not in members)
        key = (tuple(choice[n] for n in names), outside)
        if key not in seen:
            seen[key] = section_cost(traced, strategies, tables, choice, names)
        out.append(seen[key])
    return out


def _keep(out: dict, kept: set, key: tuple, nbytes: float) -> None:
    """Count a kept version of a tensor (key: tensor, placement read, Megatron-f gather)
    once in ``out["act_bytes"]``."""
    if nbytes and key not in kept:
        kept.add(key)
        out["act_bytes"] += nbytes


def _kept_outputs(traced, strategies, tables, choice, names, out, kept) -> None:
    """Charge to this section every version of its nodes' outputs that a consumer keeps
    for backward (:attr:`~autopar.planner.costs.tables.EdgeCost.saved_bytes`), except a
    section output read by the next section, which that section pays for
    (:func:`crosses_section`)."""
    members = set(names)
    for node in traced.gm.graph.nodes:
        if node.name not in members:
            continue
        for user in node.users:
            if not saves_inputs(traced.nodes[user.name]) or (
                    user.name not in members and crosses_section(traced, node.name, user.name)):
                continue
            strat = strategies[user.name][choice[user.name]]
            for j, src in enumerate(tensor_inputs(user, traced.nodes)):
                if src is not node:
                    continue
                edge = tables.edge[(node.name, user.name, j)][(choice[node.name], choice[user.name])]
                fused = gathers_for_partial_grad(strat, j, strategies[node.name][choice[node.name]].output)
                _keep(out, kept, (node.name, strat.inputs[j], fused), edge.saved_bytes)


def _rank_costs(traced, strategies, tables, choice, layers, recompute, i, cfg, layer_costs):
    """Pipeline rank i's summed costs, recompute seconds, kept activations per micro-batch
    in flight, activations held once (the last rank's head and loss), the working set of
    the layer being run (recomputed layers rebuild their activations) and the section costs
    of its fully recomputed layers."""
    total: dict[str, float] = defaultdict(float)
    rec_s = act = held = working = 0.0
    full_layers = []
    for l in layers:
        layer = layer_costs[l]
        for key, val in layer.items():
            total[key] += val
        mode = recompute_mode(recompute[l])
        rec_s += mode.recomputed(layer["rec_fwd_s"], layer["core_fwd_s"])
        act += mode.kept(layer["act_bytes"], layer["core_act_bytes"], tables.full_ckpt_bytes)
        if mode.recomputes_layer:
            full_layers.append(layer)
        working = max(working, layer["act_bytes"])
    for section, on in (("pre", i == 0), ("post", i == head_rank(cfg))):
        if on:
            cost = section_cost(traced, strategies, tables, choice, getattr(traced, section))
            for key, val in cost.items():
                total[key] += val
            if section == "pre":
                act += cost["act_bytes"]
            else:  # the head: its inputs held to W, the loss's softmax to B
                record, args = pipeline_schedule(cfg.schedule), (
                    cfg.pp, cfg.num_micro_batches, cfg.virtual_stages)
                loss = cost["loss_act_bytes"]
                held += ((cost["act_bytes"] - loss) * record.head_weight_inputs_in_flight(*args)
                         + loss * record.head_in_flight(*args))
    if i == head_rank(cfg) and counts_tied_weight_once(cfg):  # both ends on this rank: one tensor
        total["params"] -= tied_param_numel(traced, tables, choice)
    return total, rec_s, act, held, working, full_layers


def predict(traced: TracedModel, strategies: NodeStrategies, tables: CostTables, cluster,
            decision, *, global_batch_size: int) -> Prediction:
    """The :class:`~autopar.contract.plan.Prediction` of ``decision`` (a
    :class:`~autopar.planner.costs.decision.Decision` on ``tables.config``): step time (s),
    throughput (TFLOP/s per GPU, MFU, HFU over ``cluster``'s peak), memory per pipeline rank
    by kind (bytes), each rank's memory reserve by kind and the least margin (device memory
    less reserve less peak, :mod:`autopar.planner.costs.reserve`) and what each rank should
    measure (:mod:`autopar.planner.costs.comm_bytes`).
    Per-rank sums come from walking every layer (:func:`section_cost`); the per-step
    arithmetic is :mod:`autopar.planner.costs.step`'s. Raises ValueError when the decision's
    placements ask for a transition the strategies do not offer."""
    cfg = tables.config
    p, m = cfg.pp, cfg.num_micro_batches
    stage_t, mem, parts, stats, phases = [], [], [], [], []
    hop = tables.p2p_s if p > 1 else 0.0  # c: one chunk boundary, forward and backward
    layer_costs = _layer_costs(traced, strategies, tables, decision.strategy)
    for i in range(p):  # pipeline rank i runs the layers of its v chunks
        layers = rank_layers(decision.stage_layers, p, i, schedule=cfg.schedule)
        total, rec_s, act, held, working, full_layers = _rank_costs(
            traced, strategies, tables, decision.strategy, layers, decision.recompute, i, cfg,
            layer_costs)
        phases.append({"forward": total["fwd_s"] + total["tp_fwd_s"],
                       "backward": total["bwd_s"] + total["tp_bwd_s"], "recompute": rec_s,
                       "p2p": hop, "weight_grad": total["wgrad_s"]})
        stage_t.append(total["fwd_s"] + total["bwd_s"] + total["tp_fwd_s"] + total["tp_bwd_s"] + rec_s)
        inflight = pipeline_schedule(cfg.schedule).in_flight(p, i, m, cfg.virtual_stages)
        saved = act * inflight + held  # interleaved: (chunk forwards in flight) / v
        mem.append({**model_state_bytes_by_kind(total["params"], decision.zero_stage, cfg,
                                                 total["expert_params"]),
                    "activations": saved + working})
        parts.append((total, rec_s, total["params"]))
        stats.append(stage_stats(traced, strategies, tables, decision, i, total, mem[-1], saved,
                                 full_layers))
    # bucketed DP reduction overlaps the backward (compute + TP comm) of the last micro-batch
    step, pipe, dp_s, opt_s = step_time_s(
        stage_t, [pt[2] for pt in parts], [(pt[0]["bwd_s"], pt[0]["tp_bwd_s"]) for pt in parts],
        tables, cluster, cfg, decision.zero_stage, wgrad_s=[pt[0]["wgrad_s"] for pt in parts],
        forward_s=[ph["forward"] for ph in phases],
        expert_params=[pt[0]["expert_params"] for pt in parts])
    for st in stats:
        st["step_time_s"] = step
    reserve = [rank_reserve(tables.p2p_bytes, cluster, cfg, i, sum(mem[i].values()),
                            parts[i][0]["temp_bytes"]) for i in range(p)]
    margin = min(cluster.device.memory_bytes - sum(r.values()) - sum(m.values())
                 for r, m in zip(reserve, mem))
    slow = max(range(p), key=lambda i: stage_t[i])
    total, rec_s, params = parts[slow]
    hops = hop * cfg.virtual_stages  # v boundaries per rank
    breakdown = {
        "compute": m * (total["fwd_s"] + total["bwd_s"]), "recompute": m * rec_s,
        "tp_comm": m * (total["tp_fwd_s"] + total["tp_bwd_s"]), "pp_p2p": m * hops,
        "dp_comm": dp_s, "optimizer": opt_s, "step_end": tables.step_end_s,
        "bubble": max(0.0, pipe - m * (stage_t[slow] + hops)),
    }
    if cfg.ep > 1:  # the experts' all-to-alls, priced inside their nodes' compute
        breakdown["compute"] -= m * total["a2a_s"]
        breakdown["ep_comm"] = m * total["a2a_s"]
    if total["cp_s"]:  # context parallelism's K/V all-gathers, inside attention's compute
        breakdown["compute"] -= m * total["cp_s"]
        breakdown["cp_comm"] = m * total["cp_s"]
    n = cfg.tp * p * cfg.dp
    model_flops = tables.model_flops_per_seq * global_batch_size
    core_flops = _sdpa_flops(traced)
    rec_flops = global_batch_size * sum(
        recompute_mode(r).recomputed(tables.layer_fwd_flops_per_seq, core_flops)
        for r in decision.recompute)
    peak = cluster.device.peak_flops
    return Prediction(
        step_time_s=step, tflops_per_gpu=(model_flops + rec_flops) / step / n / 1e12,
        mfu=model_flops / step / n / peak, hfu=(model_flops + rec_flops) / step / n / peak,
        peak_memory_bytes=max(sum(s.values()) for s in mem), memory_bytes_by_stage=mem,
        time_s_by_kind=breakdown, comm_bytes_by_kind=stats[slow]["comm_bytes"],
        stage_time_s=stage_t, stage_stats=stats, stage_phase_s=phases,
        memory_reserve_bytes_by_stage=reserve, memory_margin_bytes=margin)


def _sdpa_flops(traced: TracedModel) -> float:
    return sum(traced.nodes[n].flops for n in traced.layers[0] if traced.nodes[n].kind == "sdpa")
