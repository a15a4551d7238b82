"""Rewrite pass 4 of :func:`autopar.rewrite.apply_plan`: cut the graph into model chunks.

A model chunk is one entry of ``Plan.stage_layers`` (contiguous layers): pp of them (GPipe,
1F1B: one chunk per pipeline rank) or pp·v (interleaved 1F1B: chunk c on pipeline rank
c % pp, :func:`rank_chunks`).

:func:`annotate_chunks` runs before any pass (it only writes node metadata): every node
carries ``meta["autopar_chunk"]`` and, inside a layer, ``meta["autopar_layer"]``; nodes
inserted by the later passes inherit both from the node they belong to. :func:`split_chunks`
then turns the graph into one GraphModule per chunk with ``torch.fx.passes.split_module``.
A chunk must take exactly one tensor (the first: the tokens (b, s); later ones: the
activation (b, s, h)) and return one: that is what the pipeline schedule sends between ranks.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.split_module import split_module

__all__ = ["CHUNK", "LAYER", "annotate_chunks", "split_chunks", "rank_chunks"]

CHUNK, LAYER = "autopar_chunk", "autopar_layer"  # node.meta keys


def annotate_chunks(traced, stage_layers: list[list[int]]) -> None:
    """Set ``meta[CHUNK]`` (model chunk index) on every node of ``traced.gm`` and
    ``meta[LAYER]`` (layer index) on the nodes of a layer; nodes before the first layer go
    to chunk 0, those after the last to the last chunk.

    stage_layers: per chunk, [first_layer, last_layer_exclusive) (``Plan.stage_layers``).
    """
    chunk_of_layer = {l: i for i, (lo, hi) in enumerate(stage_layers) for l in range(lo, hi)}
    last = len(stage_layers) - 1
    for node in traced.gm.graph.nodes:
        info = traced.nodes[node.name]
        if info.section == "layer":
            node.meta[LAYER] = info.layer
            node.meta[CHUNK] = chunk_of_layer[info.layer]
        else:
            node.meta[CHUNK] = 0 if info.section == "pre" else last


def split_chunks(gm: fx.GraphModule, num_chunks: int) -> list[fx.GraphModule]:
    """Split ``gm`` into ``num_chunks`` GraphModules, index = chunk index (pp, or pp·v for
    interleaved plans); ``[gm]`` itself when num_chunks == 1.

    Raises ValueError when a node has no chunk (run :func:`annotate_chunks` first),
    NotImplementedError when a chunk would take or return more than one tensor.
    """
    if num_chunks == 1:
        return [gm]
    for node in gm.graph.nodes:
        if CHUNK not in node.meta:
            raise ValueError(f"node {node.name} has no model chunk; annotate_chunks first")
    split = split_module(gm, gm, lambda n: n.meta[CHUNK], keep_original_order=True)
    chunks = [getattr(split, f"submod_{i}") for i in range(num_chunks)]
    for i, chunk in enumerate(chunks):
        inputs = [n.name for n in chunk.graph.nodes if n.op == "placeholder"]
        out = next(n for n in chunk.graph.nodes if n.op == "output").args[0]
        if len(inputs) != 1 or isinstance(out, (tuple, list)):
            raise NotImplementedError(
                f"model chunk {i} takes {inputs} and returns {out}; autopar's pipeline "
                "sends exactly one tensor between pipeline stages, so layers must read only "
                "the previous layer's output (compute masks/positions inside the layer)")
    return chunks


def rank_chunks(chunks: list, pp: int, rank: int) -> list:
    """The chunks pipeline rank ``rank`` runs: chunks[rank], chunks[rank + pp], ... (the
    round-robin of interleaved 1F1B; one chunk when len(chunks) == pp)."""
    return chunks[rank::pp]
