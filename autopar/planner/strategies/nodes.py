"""Step 2 of the flow: the tensor-parallel options of every node, and the edge reshards.

A :data:`~autopar.contract.placement.Placement` says how a tensor lives on the t ranks of a TP
group: Replicate (R), Shard(d) (S<d>) or Partial (P); see :mod:`autopar.contract.placement`.

A :class:`Strategy` fixes a node's input and output placements. Linear layers get the
three Megatron options (Shoeybi et al. 2019, section 3): ``replicate``; ``column`` (weight
split by output features: R -> S(-1), input gradient partial, i.e. the *f* operator);
``row`` (weight split by input features: S(-1) -> P, completed by an all-reduce, the *g*
operator). Embeddings may be split by vocabulary rows (R -> P) when the lookup is plain
(no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``: those need the whole table or
batch). Shape-only and
element-wise ops pass shards through; scaled-dot-product attention runs on whole heads
(S1 on (b, nh, s, hd)). Anything unrecognised gets the explicit fallback ``replicate``,
which is always correct (redundant compute, no communication).

Edges reshard between a producer's output placement and a consumer's input placement:
P -> R all-reduce (forward), S -> R all-gather (forward; backward slices), R -> S slice
(forward; backward all-gathers the gradient). With sequence parallelism (Korthikanti et al.
2022, section 4.2.2) LayerNorm may also run on sequence shards (S1 of (b, s, h)) and
P -> S is a reduce-scatter (forward; backward all-gathers). Megatron's f on a tensor that
arrives sharded becomes a reduce-scatter (:func:`f_kind`). Other transitions are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from autopar.graph.aliases import written_later
from autopar.graph.annotate import NodeInfo, TracedModel
from autopar.graph.ops import linear_features, packet
from autopar.contract.placement import (PARTIAL, REPLICATE, Placement, Shard, StrategyKey,
                               format_strategy_key, shape_strategy_name)
from autopar.techniques.expert_parallel import experts_token_parallel
from autopar.techniques.tensor_parallel import tensor_parallel_mode

__all__ = ["Strategy", "node_strategies", "reshard_kinds", "f_kind", "NodeStrategies",
           "SEQUENCE_DIM", "strategies_by_key", "decode_placements",
           "tensor_inputs", "tied_groups", "param_split", "partial_grad_input", "partial_grad_params",
           "gathers_for_partial_grad"]

_SYM_SIZE = torch.ops.aten.sym_size.int

SEQUENCE_DIM = 1
"""The sequence dimension of a (b, s, h) activation."""

_PASS_THROUGH = {"gelu", "dropout", "contiguous", "elementwise"}


@dataclass(frozen=True)
class Strategy:
    """One tensor-parallel option of a node.

    name: "replicate" | "column" | "row" | "vocab" | "heads" | "sharded" | "shape_S<d>" (x.size()
        of a tensor sharded along d) | "vocab_parallel" (the loss on vocabulary-split logits).
    inputs: required placement of each tensor input (in ``node.all_input_nodes`` order
        restricted to tensor inputs; see :func:`tensor_inputs`).
    output: placement of the output.
    compute_divisor: the node's FLOPs are divided by this (t when the work is split).
    param_divisor: the node's parameters are divided by this (t when sharded).
    partial_grad_inputs: per input, True when this strategy makes that input's gradient a
        partial sum (the producer then needs Megatron's f: all-reduce in backward).
    """

    name: str
    inputs: tuple[Placement, ...]
    output: Placement
    compute_divisor: int = 1
    param_divisor: int = 1
    partial_grad_inputs: tuple[bool, ...] = ()

    @property
    def key(self) -> str:
        """The string a Plan stores for this strategy: ``"<name>:<output placement>"``, unique
        per node (:func:`autopar.contract.placement.format_strategy_key`)."""
        return format_strategy_key(self.name, self.output)

    @property
    def reads_size(self) -> bool:
        """``x.size(d)`` of a tensor sharded along d (the rewriter multiplies it by t)."""
        return StrategyKey(self.name, self.output).reads_size


NodeStrategies = dict[str, list[Strategy]]


def tensor_inputs(node: fx.Node, nodes: dict[str, NodeInfo]) -> list[fx.Node]:
    """Inputs of ``node`` that are tensors (size() ints and the like excluded)."""
    return [n for n in node.all_input_nodes if nodes[n.name].shape is not None]


def _shard(dim: int, ndim: int) -> Shard:
    return Shard(dim % ndim)


def _replicate(n_inputs: int) -> Strategy:
    return Strategy("replicate", (REPLICATE,) * n_inputs, REPLICATE,
                    partial_grad_inputs=(False,) * n_inputs)


def view_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim for dims that a sharding can pass through a view: the input
    dim must be the outermost of a group of dims whose product equals that of an output
    group, and the output dim the outermost of that group."""
    mapping: dict[int, int] = {}
    i = o = 0
    while i < len(in_shape) and o < len(out_shape):
        gi, go = i, o
        pi, po = in_shape[i], out_shape[o]
        i, o = i + 1, o + 1
        while pi != po:
            if pi < po and i < len(in_shape):
                pi *= in_shape[i]
                i += 1
            elif o < len(out_shape):
                po *= out_shape[o]
                o += 1
            else:
                return mapping
        mapping[gi] = go
    return mapping


def batch_safe_view_map(source: NodeInfo, view: NodeInfo) -> dict[int, int]:
    """:func:`view_map` of a view's input ``source`` to its output ``view`` restricted to the
    pairs that also hold at b = 2: shapes are annotated for one sequence, where a view that
    folds the batch into another dim (``x.reshape(1, -1, h)`` of (b, s, h), Inkling's
    shared experts) looks like the identity, yet at b > 1 a shard of s is not a shard of
    b·s. The b = 2 shapes double the dims ``NodeInfo.extra["batch_dims"]`` names (sizes are
    linear in b); a node annotated without them keeps the b = 1 map."""
    mapping = view_map(tuple(source.shape), tuple(view.shape))
    dims_in, dims_out = source.extra.get("batch_dims"), view.extra.get("batch_dims")
    if dims_in is None or dims_out is None:
        return mapping

    def doubled(shape, dims):
        return tuple(2 * n if d in dims else n for d, n in enumerate(shape))
    at_two = view_map(doubled(source.shape, dims_in), doubled(view.shape, dims_out))
    return {i: o for i, o in mapping.items() if at_two.get(i) == o}


def _strategies_for(node: fx.Node, info: NodeInfo, nodes: dict[str, NodeInfo],
                    gm: fx.GraphModule, tp: int, sequence_parallel: bool = False) -> list[Strategy]:
    ins = tensor_inputs(node, nodes)
    base = [_replicate(len(ins))]
    kind, shape = info.kind, info.shape
    if (tp > 1 and tensor_parallel_mode(sequence_parallel).shards_sequence
            and kind == "layernorm" and len(ins) == 1 and shape
            and len(shape) == 3 and shape[SEQUENCE_DIM] % tp == 0):
        seq = Shard(SEQUENCE_DIM)  # per-token normalisation: runs on sequence shards
        return base + [Strategy("sharded", (seq,), seq, tp, 1, (False,))]
    if (tp > 1 and kind == "nontensor" and node.target in ("size", _SYM_SIZE) and len(ins) == 1
            and nodes[ins[0].name].shape):  # x.size(d) reads any shard (d sharded: * t)
        in_shape = nodes[ins[0].name].shape
        base += [Strategy(shape_strategy_name(d), (Shard(d),), REPLICATE, 1, 1, (False,))
                 for d in range(len(in_shape)) if in_shape[d] % tp == 0]
    if tp == 1 or info.kind in ("input", "nontensor", "other", "layernorm", "param"):
        return base
    if node.op == "call_function" and packet(node.target) is not None:
        from autopar.planner.strategies.aten import aten_strategies  # it builds on this module

        return base + aten_strategies(node, info, nodes, ins, tp)
    if kind == "output":  # the loss reads the logits: whole, or vocabulary-parallel
        base = [Strategy("replicate", (REPLICATE,) * len(ins), REPLICATE)]
        logits = nodes[ins[0].name].shape if len(ins) == 1 else None
        if logits and len(logits) == 3 and logits[-1] % tp == 0:
            base.append(Strategy("vocab_parallel", (Shard(2),), Shard(2), tp, 1, (False,)))
        return base
    if kind == "linear":
        in_features, out_features, _ = linear_features(gm.get_submodule(node.target))
        last = _shard(-1, len(shape))
        blocks = info.extra.get("out_blocks", (out_features,))  # a fused projection's parts
        if all(b % tp == 0 for b in blocks):
            base.append(Strategy("column", (REPLICATE,), last, tp, tp, (True,)))
        if in_features % tp == 0:
            base.append(Strategy("row", (last,), PARTIAL, tp, tp, (False,)))
        return base
    if kind == "embedding":  # a plain lookup (max_norm, per-batch frequencies: whole table)
        emb = gm.get_submodule(node.target)
        if (emb.num_embeddings % tp == 0 and emb.max_norm is None
                and not emb.scale_grad_by_freq and not emb.sparse):
            base.append(Strategy("vocab", (REPLICATE,), PARTIAL, 1, tp, (False,)))
        return base
    if kind == "sdpa":  # whole heads; grouped-query k/v: whole kv heads; a mask may broadcast
        heads = [nodes[n.name].shape[1] for n in ins]
        if len(shape) == 4 and len(ins) in (3, 4) and all(h % tp == 0 for h in heads[:3]):
            mask = (REPLICATE if heads[3] == 1 else Shard(1),) if len(ins) == 4 else ()
            base.append(Strategy("heads", (Shard(1),) * 3 + mask, Shard(1), tp, 1,
                                 (False,) * 3 + (False,) * len(mask)))
        return base
    shardable = [d for d in range(len(shape)) if shape[d] % tp == 0]
    if kind in _PASS_THROUGH and len(ins) == 1:
        base += [Strategy("sharded", (Shard(d),), Shard(d), tp, 1, (False,)) for d in shardable]
    elif kind == "add" and len(ins) == 2 and all(nodes[n.name].shape == shape for n in ins):
        base += [Strategy("sharded", (Shard(d),) * 2, Shard(d), tp, 1, (False,) * 2)
                 for d in shardable]
    elif kind == "transpose" and node.target == "transpose" and len(ins) == 1:
        a, b = (d % len(shape) for d in node.args[1:3])
        swap = {a: b, b: a}
        base += [Strategy("sharded", (Shard(swap.get(d, d)),), Shard(d), 1, 1, (False,))
                 for d in shardable]
    elif kind == "view" and len(ins) == 1:
        base += _view_strategies(node, nodes[ins[0].name], info, tp)
    return base


def _view_strategies(node: fx.Node, source: NodeInfo, info: NodeInfo, tp: int
                     ) -> list[Strategy]:
    """Shards pass a view/reshape only where the target size is inferred (-1), so that
    the unchanged call computes the local size on a shard, and only along dims the view
    maps at every batch size (:func:`batch_safe_view_map`)."""
    size_args = node.args[1:]
    if len(size_args) == 1 and isinstance(size_args[0], (tuple, list)):
        size_args = tuple(size_args[0])
    in_shape, out_shape = source.shape, info.shape
    out: list[Strategy] = []
    for d_in, d_out in batch_safe_view_map(source, info).items():
        inferred = d_out < len(size_args) and size_args[d_out] == -1
        if inferred and in_shape[d_in] % tp == 0 and out_shape[d_out] % tp == 0:
            out.append(Strategy("sharded", (Shard(d_in),), Shard(d_out), 1, 1, (False,)))
    return out


def node_strategies(traced: TracedModel, tp: int, sequence_parallel: bool = False,
                    ep: int = 1) -> NodeStrategies:
    """Every node's strategies at TP size ``tp`` (one "replicate" strategy when tp == 1);
    ``sequence_parallel`` adds LayerNorm on sequence shards. Under expert parallelism over
    TP (``ep`` > 1 with tp > 1: :func:`~autopar.techniques.expert_parallel.
    experts_token_parallel`) a MoE layer's experts call has one strategy, "sharded": its
    (T, h) rows and (T, k) routing split over the TP ranks (S0), the experts whole, T/t
    tokens' work (Megatron-Core's MoE layer under expert-TP 1); refused (no strategy, so
    the plan cannot be made) when t does not divide T.

    Tied parameters (the lm_head sharing the token embedding) must be split the same way;
    the solver enforces that with :func:`tied_groups`.
    """
    gm, twins = traced.gm, _layer_twins(traced)
    # written in place, or viewing a storage a later node writes (MLA's key buffer, a
    # router's div_): a reshard would hand the write, or a later reader, a stale copy
    # (autopar.graph.aliases), so they stay whole; readers reshard after the writes
    written = written_later(gm.graph) if tp > 1 else set()
    on_tokens = experts_token_parallel(tp, ep)
    out: NodeStrategies = {}
    for node in gm.graph.nodes:  # a twin's layer comes first in graph order
        twin = twins.get(node.name)
        out[node.name] = out[twin] if twin is not None else _strategies_for(
            node, traced.nodes[node.name], traced.nodes, gm, tp, sequence_parallel)
        if on_tokens and "experts" in traced.nodes[node.name].extra:
            out[node.name] = _experts_on_tokens(node, traced.nodes, tp)
        if node.name in written:
            out[node.name] = [s for s in out[node.name] if s.name == "replicate"]
        grads = tuple(not traced.nodes[node.name].no_grad and traced.nodes[u.name].carries_grad
                      for u in tensor_inputs(node, traced.nodes))  # no gradient: no f
        if not all(grads):
            out[node.name] = [replace(s, partial_grad_inputs=tuple(
                p and g for p, g in zip(s.partial_grad_inputs, grads))) for s in out[node.name]]
    return out


def _experts_on_tokens(node: fx.Node, nodes: dict[str, NodeInfo], tp: int) -> list[Strategy]:
    """An experts call on this TP rank's rows: every tensor input and the output S0 (rows
    are tokens, so any split of them is the same per-token work), FLOPs divided by t."""
    ins = tensor_inputs(node, nodes)
    if any(nodes[n.name].shape[0] % tp for n in ins):
        return []
    rows = Shard(0)
    return [Strategy("sharded", (rows,) * len(ins), rows, tp, 1, (False,) * len(ins))]


def _layer_twins(traced: TracedModel) -> dict[str, str]:
    """Node of layer k >= 2 -> the node at its place in layer 1, where the two layers hold
    the same ops on the same shapes and parameters: its strategies are the same (a node's
    strategies read only its own and its inputs' shapes, and layer k reads layer k - 1 as
    layer 1 reads layer 0), so they are computed once (GPT-3's 96 layers: 1 s a TP size)."""
    if len(traced.layers) < 3:
        return {}
    nodes = traced.nodes

    def signature(name: str) -> tuple:
        info = nodes[name]
        return (info.kind, info.no_grad, info.carries_grad, info.shape, info.flops,
                info.param_numel, info.numel)
    model = [signature(n) for n in traced.layers[1]]
    twins: dict[str, str] = {}
    for layer in traced.layers[2:]:
        if [signature(n) for n in layer] == model:
            twins.update(zip(layer, traced.layers[1]))
    return twins


def strategies_by_key(options: list[Strategy], key: str, node: str, tp: int) -> Strategy:
    """The strategy of ``options`` (one node's, from :func:`node_strategies`) that a plan's
    ``key`` names. The one key -> Strategy lookup: evaluate_plan, the TP rewriter and the
    symbolic oracle all decode plans through :func:`decode_placements`.

    Raises ValueError naming the node and the valid keys when ``key`` is not among them.
    """
    for strategy in options:
        if strategy.key == key:
            return strategy
    raise ValueError(f"placement {key!r} of node {node} is not valid at tp={tp}; valid: "
                     f"{sorted(s.key for s in options)}")


def decode_placements(traced: TracedModel, placements: dict[str, str], tp: int,
                      sequence_parallel: bool = False, ep: int = 1
                      ) -> dict[str, tuple[int, Strategy]]:
    """Per node of ``traced``, (index into its :func:`node_strategies`, Strategy) for the
    plan's strategy keys ``placements``.

    Raises ValueError when a node has no placement (a plan made for another model) or a
    key is not valid at ``tp`` (see :func:`strategies_by_key`).
    """
    strategies = node_strategies(traced, tp, sequence_parallel, ep)
    missing = [name for name in strategies if name not in placements]
    if missing:
        raise ValueError(f"plan has no placement for nodes {missing[:5]}: it was made for a "
                         "different model; re-plan for this model")
    out = {}
    for name, options in strategies.items():
        chosen = strategies_by_key(options, placements[name], name, tp)
        out[name] = (options.index(chosen), chosen)
    return out


def partial_grad_input(strategy: Strategy, j: int) -> bool:
    """Does ``strategy`` make the gradient of its input j a partial sum (Megatron's f)?"""
    return bool(strategy.partial_grad_inputs and strategy.partial_grad_inputs[j])


def gathers_for_partial_grad(strategy: Strategy, j: int, src_placement: Placement) -> bool:
    """Is input j all-gathered from a shard for a consumer with a partial input gradient?
    That gather is one collective with f (all-gather forward, reduce-scatter backward:
    :class:`~autopar.runtime.tp_modules.GatherToTPRegionWithPartialGrad`), so it is not shared with
    plain gathers of the same tensor; the solver, the predictor and the rewriter agree."""
    return (partial_grad_input(strategy, j) and src_placement.is_sharded
            and strategy.inputs[j].is_replicated)


def partial_grad_params(info: NodeInfo, strategy: Strategy) -> bool:
    """Does ``strategy`` leave node ``info``'s own replicated parameters with gradients that
    are partial over TP (the runtime all-reduces them over TP after backward)? Yes for
    "sharded" (e.g. LayerNorm on sequence shards), except an experts call on the TP ranks'
    tokens: under expert parallelism over TP each TP rank holds other experts, whose
    gradients are summed over their expert-data-parallel group instead."""
    return strategy.name == "sharded" and "experts" not in info.extra


def param_split(strategy: Strategy) -> str:
    """How a strategy splits its module's weight: "none" | "rows" (dim 0) | "cols" (dim 1).

    column-linear and vocab-embedding split weight dim 0 (out_features / vocabulary);
    row-linear splits dim 1 (in_features).
    """
    return {"column": "rows", "vocab": "rows", "row": "cols"}.get(strategy.name, "none")


def tied_groups(traced: TracedModel) -> list[list[str]]:
    """Groups of node names whose modules share a weight (e.g. wte and lm_head), in graph
    order (:attr:`~autopar.graph.annotate.TracedModel.tied_weight_groups`, computed once)."""
    return [list(group) for group in traced.tied_weight_groups]


def reshard_kinds(src: Placement, dst: Placement, sequence_parallel: bool = False
                  ) -> tuple[str | None, str | None] | None:
    """Collectives that turn placement ``src`` into ``dst`` as (forward, backward) kinds
    ("all_reduce" | "all_gather" | "reduce_scatter" | None); None when the transition is
    not offered (P -> S only with ``sequence_parallel``): a partial output is completed by
    the region collectives of the tensor-parallel mode that ends in ``dst``
    (:attr:`~autopar.techniques.tensor_parallel.TensorParallelMode.region_collectives`)."""
    if src == dst:
        return (None, None)
    if src.is_partial and dst.is_replicated:
        return tensor_parallel_mode(False).region_collectives
    if src.is_partial and dst.is_sharded:
        mode = tensor_parallel_mode(sequence_parallel)
        return mode.region_collectives if mode.shards_sequence else None
    if src.is_sharded and dst.is_replicated:
        return ("all_gather", None)
    if src.is_replicated and dst.is_sharded:
        return (None, "all_gather")
    return None


def f_kind(placement: Placement) -> str:
    """The backward collective of Megatron's f on a tensor produced in ``placement``: an
    all-reduce of the partial gradient, or, when the tensor arrives sharded (and is
    all-gathered for the consumer), a reduce-scatter straight into the shard
    (:class:`~autopar.runtime.tp_modules.GatherToTPRegionWithPartialGrad`)."""
    return "reduce_scatter" if placement.is_sharded else "all_reduce"
