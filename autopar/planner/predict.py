"""Price a fully decided plan: the :class:`~autopar.plan.Prediction` of a Decision.

Walks the real graph (every layer, not a template) with the same
:class:`~autopar.planner.cost_tables.CostTables` the solver used, so ``evaluate`` of a hand layout, the
solver's chosen plan and the report agree, and the solver's objective can be checked
against this independent sum (tests do).
"""

from __future__ import annotations

import math
from collections import defaultdict

from cost_models.memory import in_flight_micro_batches
from cost_models.pipeline import pipeline_step_time_s

from autopar.planner.cost_tables import CostTables, dp_comm_s_per_param, f_cost, optimizer_s_per_param, state_bytes
from autopar.graph.annotate import TracedModel, last_saver_index
from autopar.plan import COMM_KINDS, Prediction, rank_layers
from autopar.planner.strategies import NodeStrategies, gathers_for_partial_grad, partial_grad_input, tensor_inputs

__all__ = ["section_cost", "predict"]


def section_cost(traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                 choice: dict[str, int], names: list[str]) -> dict[str, float]:
    """Sum one micro-batch's costs over ``names`` (one layer, pre or post).

    Keys: fwd_s/bwd_s (compute), tp_fwd_s/tp_bwd_s (TP comm), core_fwd_s, rec_fwd_s (what
    full recompute re-runs, see :func:`~autopar.graph.annotate.last_saver_index`), act_bytes,
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
            src_placement = strategies[src.name][choice[src.name]].output
            if partial_grad_input(strat, j):
                partial.add((src.name, src_placement))
            fused = gathers_for_partial_grad(strat, j, src_placement)
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
    if tp > 1 and any(strategies[n][choice[n]].name == "vocab_parallel" for n in names):
        out["fwd_tp_all_reduce"] += tables.vocab_loss_bytes  # vocab-parallel cross-entropy
    for u, placement in partial:  # Megatron f: one backward collective per tensor
        kind, f_s = f_cost(tables, u, placement)
        out["tp_bwd_s"] += f_s
        if tp > 1:
            out[f"tp_{kind}"] += tables.f_bytes[u]
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
                held += s["act_bytes"]  # the head and the loss, once (the output node)
    if p == 1:  # the tied weight is one tensor when both ends share a stage
        total["params"] -= _tied_numel(traced, tables, choice)
    return total, rec_s, act, held, working


def _tied_numel(traced, tables, choice) -> float:
    from autopar.planner.strategies import tied_groups

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
    p, m = cfg.pp, cfg.num_micro_batches
    comm = dict.fromkeys(COMM_KINDS, 0.0)
    comm["tp_all_reduce"] = m * (total["tp_all_reduce"] + total["fwd_tp_all_reduce"])
    comm["tp_all_gather"] = m * (total["tp_all_gather"] + total["fwd_tp_all_gather"])
    comm["tp_reduce_scatter"] = m * (total["tp_reduce_scatter"] + total["fwd_tp_reduce_scatter"])
    for l in rank_layers(decision.stage_layers, p, i):  # full recompute: forward comm again
        if decision.recompute[l] == "full":
            layer = section_cost(traced, strategies, tables, decision.strategy, traced.layers[l])
            for kind in ("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"):
                comm[kind] += m * layer[f"rec_fwd_{kind}"]
    # activations forward, their gradients backward, at every chunk cut of this rank;
    # a cut whose activation is sharded over TP (sequence parallelism) sends the shard
    n = len(decision.stage_layers)
    mine = [c for c in range(n) if c % p == i]
    cuts = [decision.stage_layers[c][1] - 1 for c in mine if c < n - 1] + \
        [decision.stage_layers[c][0] - 1 for c in mine if c > 0]
    comm["pp_p2p"] = m * sum(tables.p2p_bytes / _shards(traced, strategies, decision, l, cfg.tp)
                             for l in cuts)
    param_b, grad_b, _ = state_bytes(cfg.dtype)
    if cfg.tp > 1:  # replicated parameters used on sequence shards: all-reduced over TP
        names = [n for l in rank_layers(decision.stage_layers, p, i) for n in traced.layers[l]]
        names += (traced.pre if i == 0 else []) + (traced.post if i == p - 1 else [])
        sizes = _partial_grad_param_sizes(traced, strategies, decision.strategy, names)
        if decision.zero_stage == 3:  # once per step, on the fp32 DP shards FSDP2 keeps
            comm["tp_all_reduce"] += 4 * sum(-(-n // cfg.dp) for n in sizes)
        else:  # ZeRO-2 frees the gradients after each micro-batch
            times = m if decision.zero_stage == 2 else 1
            comm["tp_all_reduce"] += times * grad_b * sum(sizes)
    comm.update(_dp_comm_bytes(total["params"], decision.zero_stage, cfg, param_b, grad_b,
                               _fsdp_units(traced, strategies, decision, cfg)))
    if p > 1 and i in (0, p - 1):
        comm["other"] += grad_b * _tied_numel(traced, tables, decision.strategy)
    if i == p - 1 and cfg.dp > 1:
        comm["dp_all_reduce"] += 8.0  # the step's mean loss (float64) over DP
    comm["other"] += 8.0 * (p > 1)  # ... broadcast from the last stage
    return {"comm_bytes": comm, "model_state_bytes": mem["parameters"] + mem["gradients"]
            + mem["optimizer_states"], "saved_activation_bytes": saved}


def _shards(traced, strategies, decision, layer: int, tp: int) -> int:
    """t when the activation leaving ``layer`` (its last node) is sharded over TP, else 1."""
    name = traced.layers[layer][-1]
    return tp if strategies[name][decision.strategy[name]].output.is_sharded else 1


def _partial_grad_param_sizes(traced, strategies, choice, names: list[str]) -> list[int]:
    """Elements of each replicated parameter that ``names`` use on sequence shards, whose
    gradients the runtime all-reduces over TP: LayerNorm on a shard, and the bias of a row
    Linear whose partial output is reduce-scattered (``TPRewrite.partial_grad_params``)."""
    graph = {n.name: n for n in traced.gm.graph.nodes}
    sizes: list[int] = []
    for name in names:
        info, strat = traced.nodes[name], strategies[name][choice[name]]
        params = info.extra.get("param_sizes", {})
        if strat.name == "sharded":
            sizes += [int(n) for n in params.values()]
        elif strat.output.is_partial:
            to_shard = any(strategies[u.name][choice[u.name]].inputs[j].is_sharded
                           for u in graph[name].users
                           for j, src in enumerate(tensor_inputs(u, traced.nodes)) if src.name == name)
            sizes += [int(n) for key, n in params.items() if key.endswith("bias") and to_shard]
    return sizes


def _dp_comm_bytes(params: float, zero: int, cfg, param_b: int, grad_b: int,
                   units: tuple[list[int], int] | None = None) -> dict[str, float]:
    """DP payload bytes per step of :class:`autopar.runtime.zero.DistributedOptimizer` for a
    stage of ``params`` parameters: ZeRO-0 all-reduces the gradients; ZeRO-1 reduce-scatters
    them once (ZeRO-2 after each of the m micro-batches) over a buffer padded to a multiple
    of d, and all-gathers this rank's 1/d of the updated parameters.

    ZeRO-3 (:class:`autopar.runtime.fsdp.FullyShardedOptimizer`, FSDP2) needs ``units``
    from :func:`_fsdp_units`: (S_l per layer unit, S_root), the elements one rank
    all-gathers per unit. Per micro-batch every layer unit is all-gathered twice (forward,
    and backward after its reshard), the root once (kept through backward), and every
    unit's padded gradient (d * S_u elements) reduce-scattered once:
    all-gather = m * param_b * (2 * sum(S_l) + S_root), reduce-scatter =
    m * grad_b * d * (sum(S_l) + S_root)."""
    d = cfg.dp
    if d == 1:
        return {}
    if zero == 3:
        layers, root = units
        m = cfg.num_micro_batches
        return {"dp_all_gather": m * param_b * (2 * sum(layers) + root),
                "dp_reduce_scatter": m * grad_b * d * (sum(layers) + root)}
    if zero == 0:
        return {"dp_all_reduce": grad_b * params}
    padded = math.ceil(round(params) / d) * d
    times = cfg.num_micro_batches if zero == 2 else 1
    return {"dp_reduce_scatter": times * grad_b * padded, "dp_all_gather": param_b * padded / d}


def _fsdp_units(traced: TracedModel, strategies: NodeStrategies, decision, cfg
                ) -> tuple[list[int], int] | None:
    """ZeRO-3 only (else None): elements one DP rank all-gathers for each FSDP2 unit of a
    pp == 1 stage, as :mod:`autopar.runtime.fsdp` groups them: one unit per layer, the root
    holding the pre and post sections (the tied weight once). Each parameter is sharded
    by FSDP2 along dim 0, padded to a multiple of d: its shard is ceil(dim0/d) * numel/dim0
    elements of its TP-local shape (column/vocab split dim 0 by t, row splits the weight's
    dim 1 and keeps the bias whole, as ``rewrite.tensor_parallel`` does)."""
    if decision.zero_stage != 3:
        return None
    d, t = cfg.dp, cfg.tp
    seen: set[tuple[str, int | None]] = set()

    def shard_numel(names: list[str]) -> int:
        total = 0
        for name in names:
            info, strat = traced.nodes[name], strategies[name][decision.strategy[name]]
            for pname in info.params:
                shape = list(traced.gm.get_parameter(pname).shape)
                dim = None
                if (strat.name, info.kind) in (("column", "linear"), ("vocab", "embedding")):
                    dim = 0
                elif (strat.name, info.kind) == ("row", "linear") and not pname.endswith("bias"):
                    dim = 1
                if (pname, dim) in seen:  # a tied parameter is one tensor
                    continue
                seen.add((pname, dim))
                if dim is not None:
                    shape[dim] //= t
                rows = shape[0] if shape else 1
                total += -(-rows // d) * math.prod(shape[1:])
        return total

    layers = [shard_numel(names) for names in traced.layers]
    return layers, shard_numel(traced.pre + traced.post)


def _sdpa_flops(traced: TracedModel) -> float:
    return sum(traced.nodes[n].flops for n in traced.layers[0] if traced.nodes[n].kind == "sdpa")
