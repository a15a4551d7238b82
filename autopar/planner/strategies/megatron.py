"""Megatron-LM's hand-written tensor-parallel pattern as plan placements.

The hand layout that ``autopar.evaluate`` prices and the report compares against: the
same solver space (:mod:`autopar.planner.strategies.nodes`) with every node's choice forced.
"""

from __future__ import annotations


import torch

from autopar.graph.annotate import TracedModel
from autopar.graph.layer_groups import module_layers
from autopar.contract.placement import REPLICATE, Shard
from autopar.planner.strategies.nodes import (SEQUENCE_DIM, NodeStrategies, node_strategies,
                                        reshard_kinds, tensor_inputs, tied_groups)

aten = torch.ops.aten

__all__ = ["megatron_placements", "linear_roles", "moe_routers", "allowed_strategies"]


def megatron_placements(traced: TracedModel, tp: int, sequence_parallel: bool = False,
                        ep: int = 1) -> dict[str, str]:
    """Megatron-LM's hand-written TP pattern (Shoeybi et al. 2019, Fig. 3) as plan
    placements: a Linear reading a hidden-dim shard is row-split; a Linear of a layer that
    reads the residual stream (:func:`linear_roles` "in": QKV, MLP-in, SwiGLU's gate and
    up) and the LM head are column-split, an MoE router (:func:`moe_routers`) is whole;
    the token embedding is vocabulary-split;
    attention runs on whole heads; every other op keeps the placement its inputs arrive in
    (replicated when none fits), so rotary embeddings and SwiGLU's product run on shards.
    ``sequence_parallel`` (Korthikanti et al. 2022, Fig. 5): LayerNorm, dropout and residual
    adds of (b, s, h) activations run on sequence shards, so row-parallel outputs are
    reduce-scattered and column-parallel inputs all-gathered. Under expert parallelism
    (``ep`` > 1) the experts calls run on the TP ranks' tokens (expert-TP 1: their one
    strategy, :func:`~autopar.planner.strategies.nodes.node_strategies`).
    """
    strategies = node_strategies(traced, tp, sequence_parallel, ep)
    nodes, placement, out = traced.nodes, {}, {}
    tied = {n for group in tied_groups(traced) for n in group}
    roles = linear_roles(traced)
    routers = moe_routers(traced)
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    vocab = (nodes[out_node.args[0].name].shape or (None,))[-1]
    heads = {n for n in traced.post if nodes[n].kind == "linear"  # the LM head, not a
             and (nodes[n].shape or (None,))[-1] == vocab}   # prediction head's dense before it
    residual = nodes[traced.layers[0][-1]].shape if traced.layers else None
    seq = Shard(SEQUENCE_DIM)
    for node in traced.gm.graph.nodes:
        options = {s.name: s for s in strategies[node.name]}
        ins = tensor_inputs(node, nodes)
        arriving = tuple(placement.get(n.name, REPLICATE) for n in ins)
        kind, shape = nodes[node.name].kind, nodes[node.name].shape
        in_shape = nodes[ins[0].name].shape if ins else None
        hidden = Shard(len(in_shape) - 1) if in_shape else None  # the hidden (last) dim
        on_sequence = [s for s in strategies[node.name] if s.name == "sharded" and s.output == seq]
        if node.name in routers:  # Megatron-LM keeps the router whole on every TP rank
            chosen = options["replicate"]
        elif kind == "linear" and arriving and arriving[0] == hidden and "row" in options:
            chosen = options["row"]
        elif kind == "linear" and "column" in options and (
                node.name in tied or node.name in heads or roles.get(node.name) == "in"):
            chosen = options["column"]
        elif kind == "embedding" and "vocab" in options and (
                node.name in tied or (ins and nodes[ins[0].name].kind == "input")):
            chosen = options["vocab"]  # the token embedding (position embeddings stay whole)
        elif (sequence_parallel and kind in ("layernorm", "dropout", "add") and on_sequence
              and shape == residual):  # the residual stream, not e.g. an add inside GELU
            chosen = on_sequence[0]
        else:
            same = [s for s in strategies[node.name]  # pass-through: keep what arrives
                    if s.inputs == arriving and (s.name in ("replicate", "sharded", "heads",
                                                            "vocab_parallel")
                                                 or s.reads_size)]
            chosen = same[-1] if same else options.get("replicate", options.get("sharded"))
        if not all(reshard_kinds(a, want, sequence_parallel) is not None
                   for a, want in zip(arriving, chosen.inputs)):
            chosen = options.get("replicate", chosen)  # e.g. a hyper-connection stream sharded on its own dim
        # where a partial sum is completed: sequence shards of the residual stream under SP;
        # an all-reduce elsewhere (an MoE block's (tokens, h) rows have no sequence dim)
        completed = seq if sequence_parallel and shape == residual else REPLICATE
        placement[node.name] = completed if chosen.output.is_partial else chosen.output
        out[node.name] = chosen.key
    return out


def moe_routers(traced: TracedModel) -> set[str]:
    """The Linears of the layers whose output reaches a top-k through no other projection
    and not through the residual stream: an MoE block's router (gate), which Megatron-LM
    keeps whole on every TP rank (``TopKRouter``'s weight is not tensor-parallel). A
    router written as ``F.linear`` on a parameter is not a Linear node and stays whole
    by the pass-through rule."""
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    found = set()
    for names in module_layers(traced):  # one transformer layer at a time, grouped or not
        members, width = set(names), traced.nodes[names[-1]].shape
        for name in names:
            if traced.nodes[name].kind != "linear":
                continue
            frontier, seen = list(by_name[name].users), set()
            while frontier:
                n = frontier.pop()
                info = traced.nodes.get(n.name)
                if (n.name in seen or n.name not in members or info.kind == "linear"
                        or n.target is aten.linear.default
                        or (info.kind == "add" and info.shape == width)):
                    continue  # another projection, or the residual stream
                seen.add(n.name)
                if "topk" in getattr(n.target, "__name__", str(n.target)):
                    found.add(name)
                    break
                frontier.extend(n.users)
    return found


def linear_roles(traced: TracedModel) -> dict[str, str]:
    """Per Linear node of the layers: "in" when it reads the residual stream (QKV, MLP-in,
    gate and up), "out" when it reads another Linear of its layer without passing through
    the residual stream (attention-out, MLP-out). The residual stream: the layer's input
    and the adds of the layer's output shape. Megatron splits "in" by columns and "out"
    by rows (Shoeybi et al. 2019, section 3)."""
    roles: dict[str, str] = {}
    nodes = traced.nodes
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    for names in module_layers(traced):  # one transformer layer at a time, grouped or not
        members, width = set(names), nodes[names[-1]].shape
        for name in names:
            if nodes[name].kind != "linear":
                continue
            frontier, seen, role = list(by_name[name].all_input_nodes), set(), "in"
            while frontier:
                n = frontier.pop()
                if n.name in seen or n.name not in members:
                    continue
                seen.add(n.name)
                info = nodes[n.name]
                if info.kind == "linear":
                    role = "out"
                    break
                if info.kind == "add" and info.shape == width:
                    continue  # the residual stream
                frontier.extend(n.all_input_nodes)
            roles[name] = role
    return roles


def allowed_strategies(traced: TracedModel, strategies: NodeStrategies, tp: int,
                       sequence_parallel: bool, cache, support,
                       ep: int = 1) -> dict[str, set[str]] | None:
    """The strategy keys each node may take under ``support`` (an
    :class:`autopar.contract.support.RuntimeSupport`): None (any) unless its placements are
    "megatron", then Megatron-LM's (:func:`megatron_placements`), and for the activations
    that cross a pipeline cut also the replicated ones (a pipeline send is whole here;
    Megatron-LM sends sequence shards under SP, so the SP plans pay an all-gather more).
    ``strategies``: :func:`node_strategies` at (tp, sequence_parallel); ``cache`` (the search's
    :class:`~autopar.planner.costs.cache.SearchCache`) keeps the answer per (tp,
    sequence_parallel). The cost tables keep every strategy,
    so a plan is priced alike in any search and by ``autopar.evaluate_plan``."""
    if support.placements != "megatron" or tp == 1:
        return None
    def compute() -> dict[str, set[str]]:
        keys = megatron_placements(traced, tp, sequence_parallel, ep)
        cut = {traced.pre[-1], traced.layers[0][-1]} if traced.layers else set()
        return {n: {s.key for s in options if s.key == keys[n]
                    or (n in cut and s.output.is_replicated)}
                for n, options in strategies.items()}
    return cache.megatron_keys(tp, sequence_parallel, compute, ep)
