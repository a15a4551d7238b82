"""Megatron-LM's hand-written tensor-parallel pattern as plan placements.

The hand layout that ``autopar.evaluate`` prices and the report compares against: the
same solver space (:mod:`autopar.planner.strategies`) with every node's choice forced.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.graph.annotate import NodeInfo, TracedModel
from autopar.placement import REPLICATE, Shard
from autopar.planner.strategies import SEQUENCE_DIM, node_strategies, tensor_inputs, tied_groups

__all__ = ["megatron_placements"]


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
    seq = Shard(SEQUENCE_DIM)
    for node in traced.gm.graph.nodes:
        options = {s.name: s for s in strategies[node.name]}
        ins = tensor_inputs(node, nodes)
        arriving = tuple(placement.get(n.name, REPLICATE) for n in ins)
        kind, shape = nodes[node.name].kind, nodes[node.name].shape
        in_shape = nodes[ins[0].name].shape if ins else None
        hidden = Shard(len(in_shape) - 1) if in_shape else None  # the hidden (last) dim
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
                                                 or s.reads_size)]
            chosen = same[-1] if same else options["replicate"]
        completed = seq if sequence_parallel else REPLICATE  # where a partial sum is completed
        placement[node.name] = completed if chosen.output.is_partial else chosen.output
        out[node.name] = chosen.key
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
