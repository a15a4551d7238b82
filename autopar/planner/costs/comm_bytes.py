"""Predicted payload bytes per collective kind: what each pipeline rank's GPUs should measure
in one step (``ParallelizedModel.last_step_stats()["comm_bytes"]``).

Tensor-parallel bytes come from the section costs of :mod:`autopar.planner.costs.predict`; pipeline
sends from the chunk cuts; data-parallel bytes from what :class:`autopar.runtime.zero.
DistributedOptimizer` (ZeRO 0-2) and :mod:`autopar.runtime.fsdp` (ZeRO-3, FSDP2) send. Tests
compare these with the bytes the runtime's ``CommMeter`` counts over the technique matrix.
"""

from __future__ import annotations

import math

from autopar.graph.annotate import TracedModel
from autopar.contract.plan import COMM_KINDS, rank_layers
from autopar.techniques.expert_parallel import expert_data_parallel_size
from autopar.planner.costs.tables import CostTables, state_bytes
from autopar.planner.costs.step import head_rank, tied_param_numel
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.techniques.zero_stages import zero_stage
from autopar.planner.strategies import NodeStrategies, partial_grad_params, tensor_inputs

__all__ = ["stage_stats", "dp_comm_bytes", "fsdp_units"]


def stage_stats(traced: TracedModel, strategies: NodeStrategies, tables: CostTables, decision,
                i: int, total: dict[str, float], memory: dict[str, float], saved: float,
                full_layers: list[dict[str, float]]) -> dict:
    """What pipeline rank i's GPUs should measure in one step (the keys of
    ``ParallelizedModel.last_step_stats()``): payload bytes per collective kind
    (:data:`~autopar.contract.plan.COMM_KINDS`), model-state bytes and peak saved-activation bytes.

    total: rank i's summed :func:`~autopar.planner.costs.predict.section_cost` (per micro-batch);
    memory: its bytes by kind; saved: its saved activation bytes; full_layers: the section
    costs of its layers under full recompute, in layer order (their forward TP collectives
    run again in backward)."""
    cfg = tables.config
    p, m = cfg.pp, cfg.num_micro_batches
    comm = dict.fromkeys(COMM_KINDS, 0.0)
    comm["tp_all_reduce"] = m * (total["tp_all_reduce"] + total["fwd_tp_all_reduce"])
    comm["tp_all_gather"] = m * (total["tp_all_gather"] + total["fwd_tp_all_gather"])
    comm["tp_reduce_scatter"] = m * (total["tp_reduce_scatter"] + total["fwd_tp_reduce_scatter"])
    # expert parallelism: dispatch, combine and the counts in forward, both reversed in backward
    comm["ep_all_to_all"] = m * (total["ep_all_to_all"] + total["fwd_ep_all_to_all"])
    # context parallelism: K and V all-gathered in forward (again where recomputed: the
    # attention core under selective recompute), their gradients reduce-scattered
    comm["cp_all_gather"] = m * total["cp_all_gather"] * (1 + _selective_share(decision, cfg, i))
    comm["cp_reduce_scatter"] = m * total["cp_reduce_scatter"]
    for layer in full_layers:  # full recompute: forward comm again
        for kind in ("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter", "ep_all_to_all",
                     "cp_all_gather"):
            comm[kind] += m * layer[f"rec_fwd_{kind}"]
    # activations forward, their gradients backward, at every chunk cut of this rank whose
    # other side runs on another rank (a V placement's middle cut stays on rank p - 1); a
    # cut whose activation is sharded over TP (sequence parallelism) sends the shard
    n, record = len(decision.stage_layers), pipeline_schedule(cfg.schedule)
    mine = record.rank_chunks(p, n, i)
    cuts = [decision.stage_layers[c][1] - 1 for c in mine
            if c < n - 1 and record.chunk_rank(c + 1, p, n) != i] + \
        [decision.stage_layers[c][0] - 1 for c in mine
         if c > 0 and record.chunk_rank(c - 1, p, n) != i]
    comm["pp_p2p"] = m * sum(tables.p2p_bytes / _shards(traced, strategies, decision, l, cfg.tp)
                             for l in cuts)
    b = state_bytes(cfg.dtype, cfg.grad_dtype, decision.zero_stage)
    param_b, grad_b = b.gather, b.reduce
    if cfg.tp > 1:  # replicated parameters used on sequence shards: all-reduced over TP
        names = [n for l in rank_layers(decision.stage_layers, p, i, schedule=cfg.schedule)
                 for n in traced.layers[l]]
        names += (traced.pre if i == 0 else []) + (traced.post if i == head_rank(cfg) else [])
        sizes = _partial_grad_param_sizes(traced, strategies, decision.strategy, names)
        zero = zero_stage(decision.zero_stage)
        if zero.shards_parameters:  # once per step, on the fp32 DP shards FSDP2 keeps
            comm["tp_all_reduce"] += 4 * sum(-(-n // cfg.dp) for n in sizes)
        else:  # before the gradients leave: each micro-batch under ZeRO-2
            comm["tp_all_reduce"] += zero.gradient_reductions(m) * grad_b * sum(sizes)
    # expert gradients are all-reduced over the t·d/ep ranks holding the same experts: none
    # when that group is one rank
    alone = total["expert_params"] if expert_data_parallel_size(cfg.tp, cfg.dp, cfg.ep) == 1 \
        else 0.0
    comm.update(dp_comm_bytes(total["params"] - alone, decision.zero_stage, cfg, param_b, grad_b,
                               fsdp_units(traced, strategies, decision, cfg)))
    if head_rank(cfg) != 0 and i in (0, head_rank(cfg)):  # the tied pair on two ranks
        comm["other"] += grad_b * tied_param_numel(traced, tables, decision.strategy)
    # the step's mean loss and squared gradient norm, two float64 all-reduced over the world
    # (autopar.runtime.engine: one collective decides clipping and non-finite steps)
    comm["other"] += 16.0 * (cfg.tp * p * cfg.dp > 1)
    return {"comm_bytes": comm, "model_state_bytes": memory["parameters"] + memory["gradients"]
            + memory["optimizer_states"], "saved_activation_bytes": saved}


def _selective_share(decision, cfg, i: int) -> float:
    """The share of pipeline rank i's layers under selective recompute (their attention
    core, context parallelism's all-gathers in it, runs again in backward)."""
    layers = rank_layers(decision.stage_layers, cfg.pp, i, schedule=cfg.schedule)
    return sum(decision.recompute[l] == "selective" for l in layers) / max(1, len(layers))


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
        if partial_grad_params(info, strat):
            sizes += [int(n) for n in params.values()]
        elif strat.output.is_partial:
            to_shard = any(strategies[u.name][choice[u.name]].inputs[j].is_sharded
                           for u in graph[name].users
                           for j, src in enumerate(tensor_inputs(u, traced.nodes)) if src.name == name)
            sizes += [int(n) for key, n in params.items() if key.endswith("bias") and to_shard]
    return sizes


def dp_comm_bytes(params: float, zero: int, cfg, param_b: int, grad_b: int,
                   units: tuple[list[int], int] | None = None) -> dict[str, float]:
    """DP payload bytes per step of :class:`autopar.runtime.zero.DistributedOptimizer` for a
    stage of ``params`` parameters: ZeRO-0 all-reduces the gradients; ZeRO-1 reduce-scatters
    them once (ZeRO-2 after each of the m micro-batches) over a buffer padded to a multiple
    of d, and all-gathers this rank's 1/d of the updated parameters.

    ZeRO-3 (:class:`autopar.runtime.fsdp.FullyShardedOptimizer`, FSDP2) needs ``units``
    from :func:`fsdp_units`: (S_l per layer unit, S_root), the elements one rank
    all-gathers per unit. Per micro-batch every layer unit is all-gathered twice (forward,
    and backward after its reshard), the root once (kept through backward), and every
    unit's padded gradient (d * S_u elements) reduce-scattered once:
    all-gather = m * param_b * (2 * sum(S_l) + S_root), reduce-scatter =
    m * grad_b * d * (sum(S_l) + S_root)."""
    d = cfg.dp
    if d == 1:
        return {}
    record = zero_stage(zero)
    if record.shards_parameters:
        layers, root = units
        m = cfg.num_micro_batches
        return {"dp_all_gather": m * param_b * (2 * sum(layers) + root),
                "dp_reduce_scatter": m * grad_b * d * (sum(layers) + root)}
    if record.gradient_collective == "all_reduce":
        return {"dp_all_reduce": grad_b * params}
    padded = math.ceil(round(params) / d) * d
    times = record.gradient_reductions(cfg.num_micro_batches)
    return {"dp_reduce_scatter": times * grad_b * padded, "dp_all_gather": param_b * padded / d}


def fsdp_units(traced: TracedModel, strategies: NodeStrategies, decision, cfg
                ) -> tuple[list[int], int] | None:
    """ZeRO-3 only (else None): elements one DP rank all-gathers for each FSDP2 unit of a
    pp == 1 stage, as :mod:`autopar.runtime.fsdp` groups them: one unit per layer, the root
    holding the pre and post sections (the tied weight once). Each parameter is sharded
    by FSDP2 along dim 0, padded to a multiple of d: its shard is ceil(dim0/d) * numel/dim0
    elements of its TP-local shape (column/vocab split dim 0 by t, row splits the weight's
    dim 1 and keeps the bias whole, as ``rewrite.tensor_parallel`` does)."""
    if not zero_stage(decision.zero_stage).shards_parameters:
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
