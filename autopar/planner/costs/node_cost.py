"""What one graph node costs under one strategy, for one micro-batch on one GPU.

:func:`node_cost` is the per-node cost function that :mod:`autopar.planner.costs.tables`
tabulates for the CP-SAT model, :func:`~autopar.planner.costs.predict.predict` and the
exhaustive oracle alike (they read the same tables), and that the search's bounds call
directly; :func:`loss_cost` prices the cross-entropy as the graph's output node. The
assumptions are :mod:`autopar.planner.costs.tables`' (GEMMs at their shapes, other ops
memory-bound, backward twice the forward), plus the host's per-node dispatch and
checkpointing overheads of the device (``DeviceSpec.op_overhead_s``,
``DeviceSpec.recompute_overhead_s``), added to a CPU rank's compute and the longer of the
two on a GPU (``DeviceSpec.async_dispatch``: :func:`cost_models.compute.dispatched_time_s`).
One call of a MoE layer's experts module (:mod:`autopar.graph.experts`, ``extra["inner"]``)
adds its ops' saved activations, the memory traffic of its ops that are not GEMMs and one
dispatch per op; under expert parallelism (``ep`` > 1) its GEMMs, all-to-alls and
parameters are :func:`~autopar.planner.costs.expert_cost.expert_parallel_price`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models import comm, compute
from cost_models.hardware import Cluster
from cost_models.reserve import loss_temporary_bytes

from autopar.graph.annotate import ACTIVATION_BYTES, MASK_BYTES
from autopar.planner.costs.expert_cost import expert_parallel_price
from autopar.planner.costs.matmul_cost import gemm_times_s
from autopar.planner.strategies import Strategy

__all__ = ["StrategyCost", "node_cost", "loss_cost", "dispatches", "LOSS_BYTES_PER_LOGIT"]

LOSS_BYTES_PER_LOGIT = 4        # fp32 softmax kept by cross-entropy


@dataclass(frozen=True)
class StrategyCost:
    """Cost of one node under one strategy, for one micro-batch on one GPU.

    fwd_s / bwd_s: compute seconds; param_numel: parameter elements held;
    saved_bytes: activation bytes kept for backward; core_saved_bytes: the part selective
    recompute drops; core_fwd_s: forward seconds selective recompute repeats;
    temp_bytes: bytes allocated and freed within the step, not kept (the loss's fp32
    logits, :func:`cost_models.reserve.loss_temporary_bytes`): part of the memory reserve;
    rec_s: seconds full recompute spends on the node (its forward again plus the
    checkpoint's bookkeeping, ``DeviceSpec.recompute_overhead_s``); wgrad_s: the part of
    ``bwd_s`` that computes weight gradients (W of Qi et al. 2024, which a zero-bubble
    schedule defers; the rest, B, is the input gradient): the weight-gradient GEMMs' share
    of the backward GEMMs (:func:`~autopar.planner.costs.matmul_cost.gemm_times_s`), 0 for a node
    without weights or without GEMMs. Under expert parallelism (an experts node,
    :mod:`autopar.planner.costs.expert_cost`): a2a_s, the all-to-alls' seconds (part of
    fwd_s and bwd_s, two in each); a2a_fwd_bytes / a2a_bwd_bytes, the bytes they send in
    forward and backward; expert_param_numel, the part of param_numel whose gradients are
    reduced over the expert-data-parallel group. Under context parallelism (an attention
    node of a trace annotated by :mod:`autopar.graph.context_parallel`): cp_s, the seconds
    of the all-gather of K and V (part of fwd_s, core_fwd_s and rec_s) and of the
    reduce-scatter of their gradients (part of bwd_s); cp_fwd_bytes / cp_bwd_bytes, their
    payloads as the runtime's meter counts them (the all-gather's input, the
    reduce-scatter's).
    """

    fwd_s: float
    bwd_s: float
    param_numel: float
    saved_bytes: float
    core_saved_bytes: float
    core_fwd_s: float
    temp_bytes: float = 0.0
    rec_s: float = 0.0
    wgrad_s: float = 0.0
    a2a_s: float = 0.0
    a2a_fwd_bytes: float = 0.0
    a2a_bwd_bytes: float = 0.0
    expert_param_numel: float = 0.0
    cp_s: float = 0.0
    cp_fwd_bytes: float = 0.0
    cp_bwd_bytes: float = 0.0


def _param_numel(info, strat: Strategy) -> float:
    """Parameter elements held under ``strat``: a row-parallel Linear shards its weight but
    keeps the whole bias (added once after the all-reduce); other splits shard everything."""
    sizes = info.extra.get("param_sizes", {})
    if strat.name == "row":
        return sum(n if name.endswith("bias") else n / strat.param_divisor
                   for name, n in sizes.items())
    return info.param_numel / strat.param_divisor


def loss_cost(strat: Strategy, logits: float, tokens: float, tp: int, cluster: Cluster,
               tp_link, act_bytes: int = ACTIVATION_BYTES, temporaries: bool = True
               ) -> StrategyCost:
    """Cross-entropy on the last stage, as the output node's cost, for ``logits`` elements
    (b·s·V) of ``tokens`` (b·s) per micro-batch: passes over fp32 logits and their saved
    softmax (LOSS_BYTES_PER_LOGIT each), no faster than an exp per logit. "vocab_parallel" (Megatron's
    vocab-parallel cross-entropy, Shoeybi et al. 2019 section 3) works on this rank's V/t
    columns and all-reduces three (b, s) fp32 tensors over TP in forward (the row max, the
    target logit and the sum of exponentials); "replicate" needs the whole logits; plus the
    device's ``op_overhead_s`` (one op: forward once, backward twice). Its
    temporaries (fp32 copies of the logits beside the saved softmax) are ``temp_bytes``
    (0 unless ``temporaries``: the cluster's ``memory_reserve.step_temporaries``)."""
    div, dev = (tp if strat.name == "vocab_parallel" else 1), cluster.device
    fwd = compute.dispatched_time_s(compute.elementwise_time_s(
        LOSS_BYTES_PER_LOGIT * logits / div, logits / div, dev), 1, dev)  # an exp per logit
    comm_s = 3 * comm.all_reduce_time_s(LOSS_BYTES_PER_LOGIT * tokens, tp, tp_link) if div > 1 else 0.0
    temp = loss_temporary_bytes(logits / div, act_bytes) if temporaries else 0.0
    return StrategyCost(fwd_s=fwd + comm_s, bwd_s=2.0 * fwd, param_numel=0.0, core_fwd_s=0.0,
                        saved_bytes=LOSS_BYTES_PER_LOGIT * logits / div, core_saved_bytes=0.0,
                        temp_bytes=temp, rec_s=fwd + comm_s)


def node_cost(info, strat: Strategy, b: int, cluster: Cluster, tp: int, in_numel: int,
              act_bytes: int = ACTIVATION_BYTES, attention: str = "math",
              ep: int = 1) -> StrategyCost:
    """One micro-batch's cost of node ``info`` under ``strat`` on one GPU: matmuls
    (linear, attention, batched matmul, and those of kind "other": a router's ``F.linear``,
    a MoE layer's grouped matmuls, ``extra["gemms"]``) at their GEMM shapes (:func:`gemm_times_s`: the
    calibrated in-tile rate with tile and wave quantisation), attention's softmax passes
    over the s×s scores (``attention="math"``), a batched matmul no faster than the memory
    traffic of its inputs and output (roofline), every other op memory-bound over its
    ``in_numel`` input and output elements of ``act_bytes`` bytes (views, transposes and
    dropout with p = 0 move none; erf-GELU no faster than an erf per element:
    :func:`cost_models.compute.elementwise_time_s`), plus the device's per-node host overhead
    (``op_overhead_s``, :func:`dispatches`; on a GPU the longer of the two, not the sum:
    :func:`cost_models.compute.dispatched_time_s`); backward = 2 × forward for non-matmul ops
    (Narayanan et al. 2021, section 5.1); full recompute repeats the forward plus the
    device's ``recompute_overhead_s`` (``rec_s``, and selective recompute's ``core_fwd_s``);
    saved bytes divided by t when the output is sharded; an experts call as the module
    docstring says; a ``torch.no_grad()`` node (``info.no_grad``) has no backward. ``b``:
    micro-batch size (per-sequence nodes scale by it); ``ep``: expert-parallel degree."""
    inner = info.extra.get("inner")  # (saved, moved elements, ops) of an experts call
    if inner and ep > 1:  # the view holds this rank's share: no further division
        expert = expert_parallel_price(info, b, cluster, ep, act_bytes, strat.compute_divisor)
        return expert.applied(node_cost(expert.info, replace(strat, compute_divisor=1), b,
                                        cluster, tp, in_numel, act_bytes, attention), ep)
    dev, div = cluster.device, strat.compute_divisor
    b = b if info.per_sequence else 1
    wgrad_share = 0.0  # of the backward
    ops = inner[2] if inner else 1
    if info.kind in ("linear", "sdpa", "matmul") or info.extra.get("gemms"):
        fwd, bwd, wgrad = gemm_times_s(info, strat, b, dev, attention)
        if inner:  # an experts module's other ops (sort, gathers, gate): memory-bound
            memory = compute.elementwise_time_s(act_bytes * inner[1] * b, 0.0, dev)
            fwd, bwd = fwd + memory, bwd + 2.0 * memory
        wgrad_share = wgrad / bwd if bwd else 0.0
        if info.kind == "sdpa" and attention == "math":  # softmax & co. on the s×s scores
            passes = info.extra.get("score_passes_elems", 0)
            memory = compute.memory_bound_time_s(act_bytes * passes * b / div, dev)
            fwd, bwd = fwd + memory, bwd + 2.0 * memory
        elif info.kind == "matmul":  # e.g. eager attention's q·kᵀ writes the s×s scores
            memory = compute.memory_bound_time_s(act_bytes * (in_numel + info.numel) * b / div, dev)
            fwd, bwd = max(fwd, memory), max(bwd, 2.0 * memory)
    elif info.kind in ("view", "transpose", "input", "output", "nontensor") or (
            info.kind == "dropout" and not info.mask_elems):  # p = 0: the input passes through
        fwd = bwd = 0.0
    else:  # erf-GELU computes an erf per element (DeviceSpec.transcendental_gelems_per_s)
        erf = info.numel * b / div if info.kind == "gelu" else 0.0
        fwd = compute.elementwise_time_s(act_bytes * (in_numel + info.numel) * b / div, erf, dev)
        bwd = 2.0 * fwd
    rec = fwd
    if info.no_grad:  # a torch.no_grad() region: no backward
        bwd = wgrad_share = 0.0
    if dispatches(info):  # the host's dispatch of the node: forward once, backward twice
        fwd = compute.dispatched_time_s(fwd, ops, dev)
        bwd = compute.dispatched_time_s(bwd, 0 if info.no_grad else 2 * ops, dev)
        rec = fwd + dev.recompute_overhead_s
    sharded = strat.output.is_sharded
    # the attention core's bytes are part of what the layer saves (selective drops them);
    # the output itself, when a consumer keeps it, is priced on the edge (EdgeCost.saved_bytes)
    core = info.core_bytes_at(act_bytes, attention, tp) * b / (tp if sharded else 1)
    saved = MASK_BYTES * info.mask_elems * b / (tp if sharded else 1) + core
    saved += act_bytes * inner[0] * b if inner else 0.0
    cost = StrategyCost(fwd_s=fwd, bwd_s=bwd, param_numel=_param_numel(info, strat),
                        saved_bytes=saved, core_saved_bytes=core,
                        core_fwd_s=rec if info.kind == "sdpa" else 0.0, rec_s=rec,
                        wgrad_s=wgrad_share * bwd)
    return _context_parallel(cost, info, b / div, cluster, tp, act_bytes)


def _context_parallel(cost: StrategyCost, info, b: float, cluster: Cluster, tp: int,
                      act_bytes: int) -> StrategyCost:
    """``cost`` of an attention node under context parallelism (``extra["cp"]``: its
    trace's annotation) with the all-gather of this rank's K and V in forward (again when
    recomputed) and the reduce-scatter of their gradients in backward, over the CP group
    (c ranks of stride t: :func:`cost_models.comm.group_link`), exposed (Llama 3's
    all-gather CP, arXiv:2407.21783 section 3.3.2, does not overlap it); ``b``: the
    sequences per micro-batch over the heads' split."""
    cp = info.extra.get("cp", 1)
    if cp == 1:
        return cost
    local = act_bytes * info.extra["cp_gather_elems"] * b  # this rank's K and V
    link = comm.group_link(cluster, cp, tp)
    gather = comm.all_gather_time_s(cp * local, cp, link)
    scatter = comm.reduce_scatter_time_s(cp * local, cp, link)
    return replace(cost, fwd_s=cost.fwd_s + gather, bwd_s=cost.bwd_s + scatter,
                   core_fwd_s=cost.core_fwd_s + gather, rec_s=cost.rec_s + gather,
                   cp_s=gather + scatter, cp_fwd_bytes=local, cp_bwd_bytes=cp * local)


def dispatches(info) -> bool:
    """Does node ``info`` run an op of its own at run time (every tensor node, views and
    transposes included; not the graph's inputs, outputs or non-tensor values), so that
    the device's ``op_overhead_s`` applies to it?"""
    return info.kind not in ("input", "output", "nontensor")
