"""The one adapter from a traced graph + parallel decisions to ``cost_models``.

The solver, ``autopar.evaluate`` of a hand-written layout and the report all price plans
through these functions, so every comparison is apples to apples.

Assumptions (the standard ones of Megatron-LM papers, stated once):

* bf16/fp16 mixed precision: 2-byte activations and communication, mixed-precision Adam
  model states (2 + 2 + 12 bytes per parameter, ZeRO paper section 3.1); with fp32
  gradients (``Config.grad_dtype``, what Megatron-LM and torchtitan run by default) the
  gradient buffer and its reductions are 4 bytes per element (:func:`state_bytes`);
* matmuls (linear, attention, batched matmul) run at the device's calibrated
  ``matmul_efficiency`` inside a GEMM tile, with the tile and wave quantisation of their
  (m, n, k) shapes on a GPU (:func:`cost_models.compute.gemm_time_s`), forward and the two
  backward GEMMs each at its own shape; other ops are memory-bound (read inputs + write
  output at HBM bandwidth), their backward twice the forward (Narayanan et al. 2021, 5.1);
* a pipeline send between nodes at tp > 1 is Megatron's scatter/gather (1/t per rank over
  InfiniBand, then an all-gather over NVLink; Narayanan et al. 2021, section 4.1);
* the loss (cross-entropy over the vocabulary) runs in fp32 on the last stage and keeps
  its softmax (4 bytes per logit) for backward;
* DP gradients are reduced in 25 MB buckets that overlap the backward of the last
  micro-batch (PyTorch DDP / Megatron ``DDP=torch``); what does not fit behind it is exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cost_models import comm, compute
from cost_models.hardware import Cluster

from autopar.graph.annotate import ACTIVATION_BYTES, TracedModel, saves_inputs
from autopar.contract.plan import grad_dtype_of
from autopar.planner.costs.cache import SearchCache
from autopar.planner.costs.precision import StateBytes, bytes_per_param, state_bytes
from autopar.planner.costs.node_cost import (LOSS_BYTES_PER_LOGIT, StrategyCost, dispatches, loss_cost,
                                       node_cost)
from autopar.planner.strategies import (NodeStrategies, f_kind, reshard_kinds, tensor_inputs,
                                        tied_groups)
from autopar.techniques.expert_parallel import expert_data_parallel_size, experts_token_parallel
from autopar.techniques.pipeline_schedules import DEFAULT_SCHEDULE
from autopar.techniques.zero_stages import zero_stage as zero_stage_record

__all__ = ["Config", "StrategyCost", "EdgeCost", "CostTables", "cost_tables", "node_cost", "f_cost",
           "StateBytes", "state_bytes", "bytes_per_param", "dp_comm_s_per_param", "optimizer_s_per_param", "LOSS_BYTES_PER_LOGIT",
           "dispatches", "expert_data_parallel"]

DP_BUCKET_BYTES = 25 * 2**20    # gradient all-reduce bucket (torch DDP bucket_cap_mb default)


@dataclass(frozen=True)
class Config:
    """A mesh shape and micro-batching: the part of a plan fixed before CP-SAT runs. ep: the
    expert-parallel degree, folded over dp (:mod:`autopar.techniques.expert_parallel`); cp: the
    context-parallel degree c, priced at s/c tokens, dp = c·d (:mod:`autopar.graph.context_parallel`)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    dtype: str = "bf16"
    attention: str = "math"
    sequence_parallel: bool = False
    grad_dtype: str | None = None
    ep: int = 1
    cp: int = 1

    @property
    def activation_bytes(self) -> int:  # per activation or communicated element
        return ACTIVATION_BYTES if self.dtype == "bf16" else 4

    @property
    def grads(self) -> str:  # the gradients' dtype (autopar.contract.plan.grad_dtype_of)
        return grad_dtype_of(self.dtype, self.grad_dtype)


@dataclass(frozen=True)
class EdgeCost:
    """Resharding between two strategies on one edge: seconds and payload bytes.

    saved_bytes: bytes of the version of the tensor that the consumer keeps for backward
    (0 when it keeps none): ``nbytes`` when it reads the tensor whole (replicated or
    partial, all-gathered or all-reduced if need be), ``nbytes/t`` when it reads a shard
    (this rank's slice, or a reduce-scatter). A tensor costs the sum of its kept versions,
    each once (:func:`autopar.planner.costs.predict.section_cost`); its producer's
    :class:`StrategyCost` holds only dropout masks and the attention core.
    """

    fwd_s: float
    bwd_s: float
    fwd_kind: str | None
    bwd_kind: str | None
    nbytes: float
    saved_bytes: float = 0.0


@dataclass
class CostTables:
    """All coefficients the solver and the predictor need for one :class:`Config`.

    node[name][k]: StrategyCost of strategy k; edge[(u, v, j)][(ku, kv)]: EdgeCost or None
    (transition not offered); f_s[u], f_bytes[u]: Megatron-f all-reduce (backward) when a
    consumer makes u's gradient partial, f_rs_s[u] the reduce-scatter that replaces it when
    u arrives sharded (:func:`f_cost`); p2p_s: one activation send between stages, fwd+bwd;
    vocab_loss_bytes: payload of the vocabulary-parallel cross-entropy's three all-reduces
    per micro-batch. The cross-entropy itself is priced as the output node
    (:func:`~autopar.planner.costs.node_cost.loss_cost`). step_end_s: the collectives that end
    every step after the pipeline (:func:`step_end_s`); dp_latency_s[z]: the DP
    collectives' latency that the per-parameter rate leaves out under ZeRO stage z
    (:func:`dp_latency_s`).
    """

    config: Config
    node: dict[str, list[StrategyCost]]
    edge: dict[tuple[str, str, int], dict[tuple[int, int], EdgeCost | None]]
    f_s: dict[str, float]
    f_bytes: dict[str, float]
    f_rs_s: dict[str, float]
    p2p_s: float
    p2p_bytes: float
    vocab_loss_bytes: float
    full_ckpt_bytes: float
    model_flops_per_seq: float
    layer_fwd_flops_per_seq: float
    step_end_s: float = 0.0
    dp_latency_s: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)


def f_cost(tables: CostTables, u: str, placement: str) -> tuple[str, float]:
    """(kind, seconds) of Megatron's f on tensor ``u`` produced in ``placement``: an
    all-reduce of the partial gradient, or a reduce-scatter when u arrives sharded
    (:func:`~autopar.planner.strategies.f_kind`). Payload bytes: ``tables.f_bytes[u]`` either way."""
    kind = f_kind(placement)
    return kind, (tables.f_rs_s if kind == "reduce_scatter" else tables.f_s).get(u, 0.0)


def dp_comm_s_per_param(zero_stage: int, cluster: Cluster, cfg: Config) -> float:
    """Seconds per parameter per step of the DP communication that backward can hide: a
    ring all-reduce of the gradients; ZeRO-1 its reduce-scatter half (the all-gather of
    the updated parameters follows the optimizer step: :func:`optimizer_s_per_param`);
    ZeRO-2 reduce-scatters after each of the m micro-batches, as DeepSpeed's stage 2 and
    our runtime do (m/2 all-reduces); ZeRO-3 (FSDP2, :mod:`autopar.runtime.fsdp`)
    all-gathers the parameters in forward and again in backward and reduce-scatters the
    gradients in every micro-batch: 1.5 all-reduces (ZeRO paper section 7.2) per
    micro-batch, 1.5·m per step, the counts :func:`autopar.planner.costs.comm_bytes.dp_comm_bytes`
    predicts in bytes (there the root unit, kept gathered through backward, saves one
    all-gather of the embeddings; not priced here)."""
    if cfg.dp == 1:
        return 0.0
    b = state_bytes(cfg.dtype, cfg.grad_dtype, zero_stage)
    per_param = _bucketed_s_per_param(comm.all_reduce_time_s, cluster, cfg, b.reduce)
    zero = zero_stage_record(zero_stage)
    if zero.shards_parameters:  # two all-gathers (an all-reduce's half each), a reduce-scatter
        gather = _bucketed_s_per_param(comm.all_reduce_time_s, cluster, cfg, b.gather)
        return (gather + 0.5 * per_param) * cfg.num_micro_batches
    if zero.gradient_collective == "reduce_scatter":  # gloo: as a whole all-reduce (LinkSpec)
        rs = _bucketed_s_per_param(comm.reduce_scatter_time_s, cluster, cfg, b.reduce)
        return rs * zero.gradient_reductions(cfg.num_micro_batches)
    return per_param


def expert_data_parallel(cfg: Config) -> Config:
    """``cfg`` as seen by the expert gradients' reduction under expert parallelism: over the
    expert-data-parallel group, t·d/ep ranks of stride ep (the stage ranks with one EP rank:
    :func:`autopar.techniques.expert_parallel.expert_ranks`; :func:`cost_models.comm.group_link`
    reads the link from size and stride), so :func:`dp_comm_s_per_param` of it is their rate."""
    return replace(cfg, dp=expert_data_parallel_size(cfg.tp, cfg.dp, cfg.ep), tp=cfg.ep, ep=1)


def _bucketed_s_per_param(collective, cluster: Cluster, cfg: Config, elem_bytes: int) -> float:
    """Seconds per parameter of ``collective`` over the DP group on ``elem_bytes``-byte
    elements, in buckets: gradients are reduced in 25 MB buckets (PyTorch DDP's
    bucket_cap_mb=25 default; Megatron's contiguous grad buffer is coarser still), so one
    ring latency per bucket."""
    link = comm.group_link(cluster, cfg.dp, cfg.tp)
    return collective(DP_BUCKET_BYTES, cfg.dp, link) * elem_bytes / DP_BUCKET_BYTES


def optimizer_s_per_param(zero_stage: int, cluster: Cluster, cfg: Config) -> float:
    """Seconds of the optimizer step per parameter: the (memory-bound) Adam step, the
    device's ``optimizer_bytes_per_param`` (fused on GPUs, torch's unfused AdamW on CPU
    processes) over its memory bandwidth, split over d ranks from ZeRO-1 on; ZeRO-1/2 end
    the step with the all-gather of the updated parameter shards, which nothing overlaps
    (:meth:`autopar.runtime.zero.DistributedOptimizer.step`)."""
    dev = cluster.device
    per_param = compute.memory_bound_time_s(dev.optimizer_bytes_per_param, dev)
    if not zero_stage_record(zero_stage).shards_optimizer or cfg.dp == 1:
        return per_param
    gather = (_bucketed_s_per_param(comm.all_gather_time_s, cluster, cfg,
                                    state_bytes(cfg.dtype, cfg.grad_dtype, zero_stage).gather)
              if zero_stage in (1, 2) else 0.0)
    return per_param / cfg.dp + gather


def cost_tables(traced: TracedModel, strategies: NodeStrategies, cluster: Cluster,
                cfg: Config, cache: SearchCache | None = None,
                template_only: bool = False) -> CostTables:
    """Price every node strategy and every edge transition for ``cfg`` on ``cluster``:
    seconds and bytes of one micro-batch on one GPU (the module docstring's assumptions;
    :func:`node_cost` per node, ``cost_models.comm`` per collective and point-to-point).

    cache: a :class:`~autopar.planner.costs.cache.SearchCache` shared by calls for one
    ``traced``, ``strategies`` per TP size and ``cluster`` (the search passes its own): configs that differ only in pp, dp, m, schedule
    or v share everything but the point-to-point cost, and nodes or edges with equal
    inputs (the same op in every layer) are priced once. The tables are the same with or
    without it; the solver and the predictor only read them, so entries may be shared.
    template_only: price only the nodes of the pre section, the template layer and the
    post section (and the edges into them), what the search's bounds read (the same
    prices; ``predict`` needs the full tables).
    """
    cache = SearchCache() if cache is None else cache
    key = (cfg.tp, cfg.micro_batch_size, cfg.activation_bytes, cfg.attention,
           cfg.sequence_parallel, template_only, cfg.ep)
    base = cache.tp_tables(key, lambda: _tp_tables(
        traced, strategies, cluster, cfg, cache,
        set(traced.pre + traced.layers[0] + traced.post) if template_only else None))
    end = step_end_s(traced, base, cluster, cfg)
    lat = tuple(dp_latency_s(z, cluster, cfg, traced.num_layers) for z in range(4))
    if cfg.pp == 1:
        return replace(base, config=cfg, p2p_s=0.0, step_end_s=end, dp_latency_s=lat)
    # Megatron scatters a send over the TP ranks and all-gathers it over NVLink when the
    # stages sit in different nodes; under SP the activation between layers is a 1/t slice
    pp_link = comm.group_link(cluster, cfg.pp, cfg.tp * cfg.dp)
    send = comm.pipeline_send_time_s(
        base.p2p_bytes, cfg.tp, pp_link, comm.group_link(cluster, cfg.tp, 1),
        scatter_gather=pp_link != cluster.intra_node, sequence_sharded=cfg.sequence_parallel)
    return replace(base, config=cfg, p2p_s=2.0 * send, step_end_s=end, dp_latency_s=lat)


def dp_latency_s(zero_stage: int, cluster: Cluster, cfg: Config, num_layers: int) -> float:
    """Seconds of DP collective latency per step beyond the bucketed rate of
    :func:`dp_comm_s_per_param` (one ring latency per 25 MiB), all exposed: the runtime's
    first bucket of 1 MiB (``autopar.runtime.buckets``; torch DDP's) is one reduction more,
    and under ZeRO-1/2 one all-gather more (ZeRO-2: its reduce-scatter per micro-batch);
    FSDP2 under ZeRO-3 runs, per micro-batch and unit (a layer each, plus the root), an
    all-gather in forward, one in backward and a reduce-scatter, each paying its latency."""
    if cfg.dp == 1:
        return 0.0
    link = comm.group_link(cluster, cfg.dp, cfg.tp)
    gather, reduce_scatter = (comm.ring_latency_s(kind, cfg.dp, link)
                              for kind in ("all_gather", "reduce_scatter"))
    zero = zero_stage_record(zero_stage)
    if zero.shards_parameters:
        return cfg.num_micro_batches * (num_layers + 1) * (2 * gather + reduce_scatter)
    if zero.gradient_collective == "all_reduce":
        return comm.ring_latency_s("all_reduce", cfg.dp, link)
    return gather + reduce_scatter * zero.gradient_reductions(cfg.num_micro_batches)


def step_end_s(traced: TracedModel, tables: CostTables, cluster: Cluster, cfg: Config) -> float:
    """Seconds of the collectives that end every step after the pipeline drains, which
    nothing overlaps (:class:`autopar.runtime.engine.Engine`): with p > 1, the all-reduce of
    the tied embedding's gradient between the first and the last stage (Megatron's
    embedding group; priced at the vocabulary-parallel shard, the tied node's smallest
    strategy, so that the term depends on the config alone); then the float64 loss and
    squared-gradient-norm all-reduce over the world (16 B: latency-bound, priced as a tree
    of 2·ceil(log2 n) link latencies, as NCCL's tree all-reduce; gloo's ring at n = 2 is
    the same two steps)."""
    world = cfg.tp * cfg.pp * cfg.dp
    end = 0.0
    if world > 1:
        end += 2 * math.ceil(math.log2(world)) * comm.group_link(cluster, world, 1).latency_s
    if cfg.pp > 1:
        numel = sum(min(c.param_numel for c in tables.node[g[-1]]) for g in tied_groups(traced)
                    if g[-1] in traced.post)
        if numel:
            link = comm.group_link(cluster, 2, cfg.tp * cfg.dp * (cfg.pp - 1))
            end += comm.all_reduce_time_s(numel * state_bytes(cfg.dtype, cfg.grad_dtype).reduce,
                                          2, link)
    return end


def _node_key(info) -> tuple:
    """Everything :func:`node_cost` reads of a node, hashable."""
    extra = info.extra
    return (info.kind, info.no_grad, info.flops, info.per_sequence, info.numel, info.param_numel,
            info.saved_elems, info.mask_elems, info.core_elems, info.core_mask_elems,
            info.flash_elems, info.lse_elems, extra.get("flash_output_aliased", False),
            extra.get("score_passes_elems", 0), extra.get("cp", 1), extra.get("cp_kv_elems", 0),
            extra.get("gemms"), extra.get("gemm_folded"), extra.get("gemm_weights", False),
            extra.get("inner"), tuple(sorted(extra.get("experts", {}).items())),
            tuple((n.endswith("bias"), v) for n, v in extra.get("param_sizes", {}).items()))


def _pricing_rows(traced: TracedModel, strategies: NodeStrategies, tp: int, sp: bool,
                  cache: SearchCache, names: set[str] | None = None, ep: int = 1) -> list[tuple]:
    """Per node, once per (tp, sequence parallelism): (name, info, node signature, input
    elements, [(source, j, edge signature, source elements, per sequence)]), where a
    signature is a small int naming one pricing problem (equal ones: the same op in every
    layer), so that :func:`_tp_tables` looks prices up instead of hashing them anew.
    ``names``: rows of these nodes only (signatures then number their own problems)."""
    return cache.pricing_rows(tp, sp, names is not None,
                              lambda: _rows(traced, strategies, names), ep)


def _rows(traced: TracedModel, strategies: NodeStrategies,
          names: set[str] | None) -> list[tuple]:
    """:func:`_pricing_rows`, computed."""
    nodes, ids, rows = traced.nodes, {}, []
    for node in traced.gm.graph.nodes:
        if names is not None and node.name not in names:
            continue
        info, options = nodes[node.name], strategies[node.name]
        ins = tensor_inputs(node, nodes)
        in_numel = sum(nodes[n.name].numel for n in ins)
        sig = ids.setdefault(("node", _node_key(info), tuple(options), in_numel), len(ids))
        edges = []
        for j, src in enumerate(ins):
            src_info = nodes[src.name]
            outs = tuple(su.output for su in strategies[src.name])
            wants = tuple(sv.inputs[j] for sv in options)
            # a parameter (or a view of one) that the consumer keeps is model state, not an
            # activation: autograd keeps a reference, no copy
            saves = saves_inputs(info) and not src_info.extra.get("param_read", False)
            grad = not info.no_grad and src_info.carries_grad  # a gradient crosses
            esig = ids.setdefault(("edge", src_info.numel, src_info.per_sequence, outs, wants,
                                   saves, grad), len(ids))
            edges.append((src.name, j, esig, src_info.numel, src_info.per_sequence, saves,
                          grad))
        rows.append((node.name, info, sig, in_numel, edges))
    return rows


def _tp_tables(traced: TracedModel, strategies: NodeStrategies, cluster: Cluster, cfg: Config,
               cache: SearchCache, names: set[str] | None = None) -> CostTables:
    """:func:`cost_tables` of ``cfg`` without the pipeline's point-to-point time (what
    depends only on tp, the micro-batch size, the dtype, attention and sequence parallelism);
    ``names``: only these nodes (and the edges into them), None: every node."""
    b, tp, nodes = cfg.micro_batch_size, cfg.tp, traced.nodes
    tp_link = comm.group_link(cluster, tp, 1)
    sp, act, attn = cfg.sequence_parallel, cfg.activation_bytes, cfg.attention
    on_tokens = experts_token_parallel(tp, cfg.ep)  # the strategies (and row set) in use
    node_tab: dict[str, list[StrategyCost]] = {}
    edge_tab: dict = {}
    f_s: dict[str, float] = {}
    f_bytes: dict[str, float] = {}
    f_rs_s: dict[str, float] = {}
    scope = names is not None  # signatures of template rows number their own problems
    for name, info, sig, in_numel, edges in _pricing_rows(traced, strategies, tp, sp, cache,
                                                          names, cfg.ep):
        node_tab[name] = cache.node_costs(  # ep prices experts calls only (node_cost)
            (tp, sp, scope, sig, b, act, attn, cfg.ep if info.extra.get("inner") else 1, on_tokens),
            lambda: [node_cost(info, st, b, cluster, tp, in_numel, act, attn, cfg.ep)
                     for st in strategies[name]])
        for src, j, esig, numel, per_sequence, saves, grad in edges:
            edge_tab[(src, name, j)] = cache.edge_costs(
                (tp, sp, scope, esig, b, act, on_tokens),
                lambda: _edge_table(tuple(su.output for su in strategies[src]),
                                    tuple(sv.inputs[j] for sv in strategies[name]),
                                    act * numel * (b if per_sequence else 1), tp, tp_link, sp,
                                    saves, grad))
        if info.shape is not None:
            nbytes = act * info.numel * (b if info.per_sequence else 1)
            f_bytes[name] = nbytes
            f_s[name], f_rs_s[name] = cache.tp_collective_s(
                nbytes, tp, lambda: (comm.all_reduce_time_s(nbytes, tp, tp_link),
                                     comm.reduce_scatter_time_s(nbytes, tp, tp_link)))
    boundary = traced.boundary_numel() * b
    p2p_bytes = act * boundary
    out, matmul = cache.graph_totals(lambda: (  # forward + backward; no_grad: forward
        next(n for n in traced.gm.graph.nodes if n.op == "output"),
        sum(i.flops / (3.0 if i.no_grad else 1.0) for i in nodes.values() if i.model_matmul)))
    logits_node = nodes[out.args[0].name]
    logits = logits_node.numel * b  # (b, s, V) fed to the loss
    tokens = logits / logits_node.shape[-1]
    vocab_loss_bytes = 3 * LOSS_BYTES_PER_LOGIT * tokens  # max, target logit, sum of exp
    node_tab[out.name] = [loss_cost(s, logits, tokens, tp, cluster, tp_link, act,
                                     cluster.memory_reserve.step_temporaries)
                          for s in strategies[out.name]]
    layer_matmul = sum(nodes[n].flops for n in traced.layers[0] if nodes[n].model_matmul)
    return CostTables(
        config=cfg, node=node_tab, edge=edge_tab, f_s=f_s, f_bytes=f_bytes, f_rs_s=f_rs_s,
        p2p_s=0.0, p2p_bytes=p2p_bytes, vocab_loss_bytes=vocab_loss_bytes,
        full_ckpt_bytes=act * boundary,
        model_flops_per_seq=3.0 * matmul, layer_fwd_flops_per_seq=layer_matmul)


def _edge_table(outs: tuple, wants: tuple, nbytes: float, tp: int, tp_link, sp: bool,
                saves: bool = False, grad: bool = True) -> dict:
    """{(ku, kv): EdgeCost | None} from producer output placements ``outs`` to consumer
    input placements ``wants`` for a tensor of ``nbytes`` (None: transition not offered);
    ``saves``: the consumer keeps its inputs for backward (:attr:`EdgeCost.saved_bytes`);
    ``grad`` False: no gradient crosses the edge (no_grad consumer, or ``carries_grad``)."""
    table = {}
    for ku, src in enumerate(outs):
        for kv, dst in enumerate(wants):
            kinds = reshard_kinds(src, dst, sp)
            if kinds is not None and not grad:
                kinds = (kinds[0], None)
            kept = nbytes / (tp if dst.is_sharded else 1) if saves else 0.0
            table[(ku, kv)] = None if kinds is None else EdgeCost(
                fwd_s=comm.collective_time_s(kinds[0], nbytes, tp, tp_link) if kinds[0] else 0.0,
                bwd_s=comm.collective_time_s(kinds[1], nbytes, tp, tp_link) if kinds[1] else 0.0,
                fwd_kind=kinds[0], bwd_kind=kinds[1], nbytes=nbytes,
                saved_bytes=kept)
    return table
