"""Stage 2: the tensor-parallel options of every node, and what each edge costs to reshard.

A *placement* says how a tensor lives on the t ranks of a TP group:

* ``"R"``   replicated: every rank holds the whole tensor;
* ``"S<d>"`` sharded: rank r holds the r-th of t equal slices along dim d;
* ``"P"``   partial: the true tensor is the sum over ranks.

A :class:`Strategy` fixes a node's input and output placements. Linear layers get the
three Megatron options (Shoeybi et al. 2019, section 3): ``replicate``; ``column`` (weight
split by output features: R -> S(-1), input gradient partial, i.e. the *f* operator);
``row`` (weight split by input features: S(-1) -> P, completed by an all-reduce, the *g*
operator). Embeddings may be split by vocabulary rows (R -> P). Shape-only and
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

from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn

from autopar.graph.annotate import NodeInfo, TracedModel

__all__ = ["Strategy", "node_strategies", "reshard_kinds", "f_kind", "NodeStrategies",
           "SEQUENCE_DIM"]

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
    inputs: tuple[str, ...]
    output: str
    compute_divisor: int = 1
    param_divisor: int = 1
    partial_grad_inputs: tuple[bool, ...] = ()


NodeStrategies = dict[str, list[Strategy]]


def tensor_inputs(node: fx.Node, nodes: dict[str, NodeInfo]) -> list[fx.Node]:
    """Inputs of ``node`` that are tensors (size() ints and the like excluded)."""
    return [n for n in node.all_input_nodes if nodes[n.name].shape is not None]


def _shard(dim: int, ndim: int) -> str:
    return f"S{dim % ndim}"


def _replicate(n_inputs: int) -> Strategy:
    return Strategy("replicate", ("R",) * n_inputs, "R", partial_grad_inputs=(False,) * n_inputs)


def _view_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> dict[int, int]:
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
            if pi < po:
                pi *= in_shape[i]
                i += 1
            else:
                po *= out_shape[o]
                o += 1
        mapping[gi] = go
    return mapping


def _strategies_for(node: fx.Node, info: NodeInfo, nodes: dict[str, NodeInfo],
                    gm: fx.GraphModule, tp: int, sequence_parallel: bool = False) -> list[Strategy]:
    ins = tensor_inputs(node, nodes)
    base = [_replicate(len(ins))]
    kind, shape = info.kind, info.shape
    if (tp > 1 and sequence_parallel and kind == "layernorm" and len(ins) == 1 and shape
            and len(shape) == 3 and shape[SEQUENCE_DIM] % tp == 0):
        seq = f"S{SEQUENCE_DIM}"  # per-token normalisation: runs on sequence shards
        return base + [Strategy("sharded", (seq,), seq, tp, 1, (False,))]
    if (tp > 1 and kind == "nontensor" and node.target == "size" and len(ins) == 1
            and nodes[ins[0].name].shape):  # x.size(d) reads any shard (d sharded: * t)
        in_shape = nodes[ins[0].name].shape
        base += [Strategy(f"shape_S{d}", (f"S{d}",), "R", 1, 1, (False,))  # unique keys
                 for d in range(len(in_shape)) if in_shape[d] % tp == 0]
    if tp == 1 or info.kind in ("input", "nontensor", "other", "layernorm"):
        return base
    if kind == "output":  # the loss reads the logits: whole, or vocabulary-parallel
        base = [Strategy("replicate", ("R",) * len(ins), "R")]
        logits = nodes[ins[0].name].shape if len(ins) == 1 else None
        if logits and len(logits) == 3 and logits[-1] % tp == 0:
            base.append(Strategy("vocab_parallel", ("S2",), "S2", tp, 1, (False,)))
        return base
    if kind == "linear":
        mod = gm.get_submodule(node.target)
        last = _shard(-1, len(shape))
        if mod.out_features % tp == 0:
            base.append(Strategy("column", ("R",), last, tp, tp, (True,)))
        if mod.in_features % tp == 0:
            base.append(Strategy("row", (last,), "P", tp, tp, (False,)))
        return base
    if kind == "embedding":
        if gm.get_submodule(node.target).num_embeddings % tp == 0:
            base.append(Strategy("vocab", ("R",), "P", 1, tp, (False,)))
        return base
    if kind == "sdpa":
        if len(shape) == 4 and shape[1] % tp == 0 and len(ins) == 3 and not node.kwargs.get("attn_mask"):
            base.append(Strategy("heads", ("S1",) * 3, "S1", tp, 1, (False,) * 3))
        return base
    shardable = [d for d in range(len(shape)) if shape[d] % tp == 0]
    if kind in _PASS_THROUGH and len(ins) == 1:
        base += [Strategy("sharded", (f"S{d}",), f"S{d}", tp, 1, (False,)) for d in shardable]
    elif kind == "add" and len(ins) == 2 and all(nodes[n.name].shape == shape for n in ins):
        base += [Strategy("sharded", (f"S{d}",) * 2, f"S{d}", tp, 1, (False,) * 2) for d in shardable]
    elif kind == "transpose" and node.target == "transpose" and len(ins) == 1:
        a, b = (d % len(shape) for d in node.args[1:3])
        swap = {a: b, b: a}
        base += [Strategy("sharded", (f"S{swap.get(d, d)}",), f"S{d}", 1, 1, (False,))
                 for d in shardable]
    elif kind == "view" and len(ins) == 1:
        base += _view_strategies(node, nodes[ins[0].name].shape, shape, tp)
    return base


def _view_strategies(node: fx.Node, in_shape, out_shape, tp: int) -> list[Strategy]:
    """Shards pass a view/reshape only where the target size is inferred (-1), so that
    the unchanged call computes the local size on a shard."""
    size_args = node.args[1:]
    if len(size_args) == 1 and isinstance(size_args[0], (tuple, list)):
        size_args = tuple(size_args[0])
    out: list[Strategy] = []
    for d_in, d_out in _view_map(tuple(in_shape), tuple(out_shape)).items():
        inferred = d_out < len(size_args) and size_args[d_out] == -1
        if inferred and in_shape[d_in] % tp == 0 and out_shape[d_out] % tp == 0:
            out.append(Strategy("sharded", (f"S{d_in}",), f"S{d_out}", 1, 1, (False,)))
    return out


def node_strategies(traced: TracedModel, tp: int, sequence_parallel: bool = False) -> NodeStrategies:
    """Every node's strategies at TP size ``tp`` (one "replicate" strategy when tp == 1);
    ``sequence_parallel`` adds LayerNorm on sequence shards.

    Tied parameters (the lm_head sharing the token embedding) must be split the same way;
    the solver enforces that with :func:`tied_groups`.
    """
    gm = traced.gm
    return {node.name: _strategies_for(node, traced.nodes[node.name], traced.nodes, gm, tp,
                                       sequence_parallel)
            for node in gm.graph.nodes}


def strategy_key(strategy: Strategy) -> str:
    """The name a Plan stores for a strategy: ``"<name>:<output placement>"`` (unique per node)."""
    return f"{strategy.name}:{strategy.output}"


def output_placement(key: str) -> str:
    """The output placement of a plan's strategy key ``"<name>:<placement>"`` ("R", "S<d>",
    "P"): the inverse of :func:`strategy_key`. Raises ValueError for anything else."""
    name, sep, placement = key.rpartition(":")
    if not sep or not name:
        raise ValueError(f"{key!r} is not a strategy key '<name>:<placement>'")
    return placement


def partial_grad_input(strategy: Strategy, j: int) -> bool:
    """Does ``strategy`` make the gradient of its input j a partial sum (Megatron's f)?"""
    return bool(strategy.partial_grad_inputs and strategy.partial_grad_inputs[j])


def gathers_for_partial_grad(strategy: Strategy, j: int, src_placement: str) -> bool:
    """Is input j all-gathered from a shard for a consumer with a partial input gradient?
    That gather is one collective with f (all-gather forward, reduce-scatter backward:
    :class:`~autopar.runtime.collectives.GatherToPartialGradTP`), so it is not shared with
    plain gathers of the same tensor; the solver, the predictor and the rewriter agree."""
    return (partial_grad_input(strategy, j) and src_placement.startswith("S")
            and strategy.inputs[j] == "R")


def param_split(strategy: Strategy) -> str:
    """How a strategy splits its module's weight: "none" | "rows" (dim 0) | "cols" (dim 1).

    column-linear and vocab-embedding split weight dim 0 (out_features / vocabulary);
    row-linear splits dim 1 (in_features).
    """
    return {"column": "rows", "vocab": "rows", "row": "cols"}.get(strategy.name, "none")


def tied_groups(traced: TracedModel) -> list[list[str]]:
    """Groups of node names whose modules share a weight (e.g. wte and lm_head)."""
    by_param: dict[str, list[str]] = {}
    for name, info in traced.nodes.items():
        for p in info.params:
            if p.endswith("weight"):
                by_param.setdefault(p, []).append(name)
    return [names for names in by_param.values() if len(names) > 1]


def reshard_kinds(src: str, dst: str, sequence_parallel: bool = False
                  ) -> tuple[str | None, str | None] | None:
    """Collectives that turn placement ``src`` into ``dst`` as (forward, backward) kinds
    ("all_reduce" | "all_gather" | "reduce_scatter" | None); None when the transition is
    not offered (P -> S only with ``sequence_parallel``)."""
    if src == dst:
        return (None, None)
    if src == "P" and dst == "R":
        return ("all_reduce", None)
    if src == "P" and dst.startswith("S"):
        return ("reduce_scatter", "all_gather") if sequence_parallel else None
    if src.startswith("S") and dst == "R":
        return ("all_gather", None)
    if src == "R" and dst.startswith("S"):
        return (None, "all_gather")
    return None


def f_kind(placement: str) -> str:
    """The backward collective of Megatron's f on a tensor produced in ``placement``: an
    all-reduce of the partial gradient, or, when the tensor arrives sharded (and is
    all-gathered for the consumer), a reduce-scatter straight into the shard
    (:class:`~autopar.runtime.collectives.GatherToPartialGradTP`)."""
    return "reduce_scatter" if placement.startswith("S") else "all_reduce"


def is_sharded(placement: str) -> bool:
    return placement.startswith("S")


def module_is_linear(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear)


def megatron_placements(traced: TracedModel, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
    """Megatron-LM's hand-written TP pattern (Shoeybi et al. 2019, Fig. 3) as plan
    placements: a Linear reading a hidden-dim shard is row-split; a Linear whose output
    feeds attention or GELU (through reshapes), or that shares the token embedding's weight,
    is column-split; the tied embedding is vocabulary-split; attention runs on whole heads;
    every other op keeps the placement its inputs arrive in (replicated when none fits).
    ``sequence_parallel`` (Korthikanti et al. 2022, Fig. 5): LayerNorm, dropout and residual
    adds of (b, s, h) activations run on sequence shards, so row-parallel outputs are
    reduce-scattered and column-parallel inputs all-gathered.
    """
    strategies = node_strategies(traced, tp, sequence_parallel)
    nodes, placement, out = traced.nodes, {}, {}
    tied = {n for group in tied_groups(traced) for n in group}
    seq = f"S{SEQUENCE_DIM}"
    for node in traced.gm.graph.nodes:
        options = {s.name: s for s in strategies[node.name]}
        ins = tensor_inputs(node, nodes)
        arriving = tuple(placement.get(n.name, "R") for n in ins)
        kind, shape = nodes[node.name].kind, nodes[node.name].shape
        hidden = _shard(-1, len(nodes[ins[0].name].shape)) if ins and nodes[ins[0].name].shape else None
        on_sequence = [s for s in strategies[node.name] if s.name == "sharded" and s.output == seq]
        if kind == "linear" and arriving and arriving[0] == hidden and "row" in options:
            chosen = options["row"]
        elif kind == "linear" and "column" in options and (node.name in tied or _feeds_core(node, nodes)):
            chosen = options["column"]
        elif kind == "embedding" and node.name in tied and "vocab" in options:
            chosen = options["vocab"]
        elif (sequence_parallel and kind in ("layernorm", "dropout", "add") and on_sequence
              and shape is not None and len(shape) == 3):
            chosen = on_sequence[0]
        else:
            same = [s for s in strategies[node.name]  # pass-through: keep what arrives
                    if s.inputs == arriving and (s.name in ("replicate", "sharded", "heads",
                                                            "vocab_parallel")
                                                 or s.name.startswith("shape"))]
            chosen = same[-1] if same else options["replicate"]
        completed = seq if sequence_parallel else "R"  # where a partial sum is completed
        placement[node.name] = completed if chosen.output == "P" else chosen.output
        out[node.name] = strategy_key(chosen)
    return out


def _feeds_core(node: fx.Node, nodes: dict[str, NodeInfo]) -> bool:
    """Does ``node``'s output reach attention or GELU through reshapes only?"""
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        kind = nodes[user.name].kind if user.name in nodes else "other"
        if kind in ("sdpa", "gelu"):
            return True
        if kind in ("view", "transpose", "contiguous"):
            frontier.extend(user.users)
    return False
