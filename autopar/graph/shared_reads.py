"""Reads that several transformer layers share belong to the prelude.

fx places a ``get_attr`` node (a parameter or buffer of the model) where it is first used.
A table on the model that every layer reads, as torchtitan's llama3 hands its
``freqs_cis`` to each layer to slice, is then read inside the first layer, which is no
longer the same op sequence as the others (the planner solves one template layer for all).
:func:`hoist_shared_reads` moves such reads to the top of the graph, after its inputs.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.graph.annotate import layer_of_nodes

__all__ = ["hoist_shared_reads"]


def hoist_shared_reads(gm: fx.GraphModule) -> list[str]:
    """Move each ``get_attr`` node of ``gm`` whose users run in more than one transformer
    layer (:func:`~autopar.graph.annotate.layer_of_nodes`) to just after the graph's
    inputs, keeping their order, with the module stack export recorded for them (their
    first user's) dropped; recompile ``gm`` when any moved. Returns their names."""
    nodes = list(gm.graph.nodes)
    layer = dict(zip(nodes, layer_of_nodes(gm)))
    anchor = None  # the last input: placeholders lead an fx graph
    for node in nodes:
        if node.op == "placeholder":
            anchor = node
    moved = []
    for node in nodes:
        if node.op == "get_attr" and len({layer[u] for u in node.users} - {None}) > 1:
            if anchor is None:
                nodes[0].prepend(node)
            else:
                anchor.append(node)
            node.meta.pop("nn_module_stack", None)  # export recorded its first user's layer
            anchor = node
            moved.append(node.name)
    if moved:
        gm.recompile()
    return moved
