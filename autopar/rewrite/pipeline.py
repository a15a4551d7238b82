"""Rewrite pass 4 of :func:`autopar.rewrite.apply_plan`: cut the graph into model chunks.

A model chunk is one entry of ``Plan.stage_layers`` (contiguous layers): pp of them (GPipe,
1F1B: one chunk per pipeline rank) or pp·v (interleaved 1F1B: chunk c on pipeline rank
c % pp; ZB-V: rank r runs chunks r and 2pp - 1 - r), placed by the schedule's record
(``rank_chunks``).

:func:`annotate_chunks` runs before any pass (it only writes node metadata): every node
carries ``meta["autopar_chunk"]`` and, inside a layer, ``meta["autopar_layer"]``; nodes
inserted by the later passes inherit both from the node they belong to. :func:`split_chunks`
then turns the graph into one GraphModule per chunk with ``torch.fx.passes.split_module``.
A chunk must take exactly one tensor (the first: the tokens (b, s); later ones: the
activation (b, s, h)) and return one: that is what the pipeline schedule sends between ranks.

Captured models compute side inputs once, before the first layer, and read them in every
layer: the causal mask, rotary cos/sin, position ids, the batch size ``sym_size(idx, 0)``
(Hugging Face Llama, GPT-2 with SDPA). They do not depend on the tokens' values, so
:func:`rematerialize_side_inputs` recomputes them in each chunk that reads them (the batch
size read off the chunk's own input) instead of sending them; what stays is one tensor.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

__all__ = ["CHUNK", "LAYER", "annotate_chunks", "rematerialize_side_inputs", "split_chunks"]

CHUNK, LAYER = "autopar_chunk", "autopar_layer"  # node.meta keys
_SYM_SIZE = torch.ops.aten.sym_size.int


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
    rematerialize_side_inputs(gm)
    split = split_module(gm, gm, lambda n: n.meta[CHUNK], keep_original_order=True)
    chunks = [getattr(split, f"submod_{i}") for i in range(num_chunks)]
    attrs = {n.name: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for chunk in chunks:
        _inline_attrs(chunk, gm, attrs)
    for i, chunk in enumerate(chunks):
        inputs = [n.name for n in chunk.graph.nodes if n.op == "placeholder"]
        out = next(n for n in chunk.graph.nodes if n.op == "output").args[0]
        if len(inputs) != 1 or isinstance(out, (tuple, list)):
            raise NotImplementedError(
                f"model chunk {i} takes {inputs} and returns {out}; autopar's pipeline "
                "sends exactly one tensor between pipeline stages and recomputes only what "
                "does not depend on the tokens (masks, positions, rotary tables), so layers "
                "must read the previous layer's output and token-free values only (a mask "
                "built from the token ids, e.g. padding, must be computed inside the layer)")
    return chunks


def _inline_attrs(chunk: fx.GraphModule, gm: fx.GraphModule, attrs: dict[str, str]) -> None:
    """Turn the placeholders ``split_module`` makes for tensor ``get_attr`` nodes (the
    parameters and buffers of a ``torch.export`` capture) back into attributes of the
    chunk, registered under the flattened path (``model.norm.weight`` ->
    ``model_norm_weight``, as split_module names submodules); the same Parameter object,
    so tied weights stay tied."""
    for node in list(chunk.graph.nodes):
        if node.op != "placeholder" or node.name not in attrs:
            continue
        owner, _, leaf = attrs[node.name].rpartition(".")
        value = getattr(gm.get_submodule(owner), leaf)
        flat = attrs[node.name].replace(".", "_")
        if isinstance(value, torch.nn.Parameter):
            chunk.register_parameter(flat, value)
        else:
            chunk.register_buffer(flat, value)
        with chunk.graph.inserting_before(node):
            attr = chunk.graph.get_attr(flat)
        attr.meta = node.meta
        node.replace_all_uses_with(attr)
        chunk.graph.erase_node(node)
    chunk.graph.lint()
    chunk.recompile()


def rematerialize_side_inputs(gm: fx.GraphModule) -> None:
    """Copy into each chunk the token-free values it reads from an earlier chunk, in place.

    A value is token-free when it is computed from parameters, buffers and constants only,
    or from the batch size ``sym_size(idx, 0)``: the causal mask, rotary cos/sin, position
    ids. Its copy is inserted before the chunk's first node, with ``sym_size(idx, 0)``
    replaced by ``sym_size(x, 0)`` of the activation ``x`` the chunk receives (same batch;
    the pipeline never splits dim 0). The chunk then reads one tensor from earlier chunks,
    or several when a value depends on the tokens, which :func:`split_chunks` refuses.
    Nodes of the chunk placed before that activation (inserted by an earlier pass beside
    their producer) move after it. Originals left without users are erased. A no-op on
    graphs without such reads (autopar's GPT computes positions inside its embedding,
    before the first cut).
    """
    graph = gm.graph
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    free: dict[fx.Node, bool] = {}  # token-free, in graph (topological) order
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            free[node] = False
        elif node.target is _SYM_SIZE and node.args[0] is placeholder:
            free[node] = node.args[1] == 0
        else:
            free[node] = all(free[n] for n in node.all_input_nodes)
    moved: list[fx.Node] = []
    for chunk in sorted({n.meta[CHUNK] for n in graph.nodes})[1:]:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        members = [n for n in graph.nodes if n.meta[CHUNK] == chunk]
        external = {i for n in members for i in n.all_input_nodes if i.meta[CHUNK] < chunk}
        side = sorted((n for n in external if free[n]), key=pos.__getitem__)
        activation = external - set(side)
        if not side or len(activation) != 1:
            continue  # nothing to copy, or split_chunks names what crosses the cut
        (x,) = activation
        # nodes the TP pass inserted for this chunk next to their producers (a gather of
        # a side value) may precede x; they cannot depend on it, so they move after it
        early = [n for n in members if pos[n] < pos[x]]
        if any(u.meta[CHUNK] < chunk for n in early for u in n.users):
            continue
        anchor = x
        for node in early:
            anchor.append(node)
            anchor = node
        first = next(n for n in graph.nodes if n.meta[CHUNK] == chunk)
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for node in sorted(_ancestry(side), key=pos.__getitem__):
                if node.target is _SYM_SIZE and node.args[0] is placeholder:
                    new = graph.call_function(_SYM_SIZE, (x, 0))
                else:
                    new = graph.node_copy(node, copies.__getitem__)
                new.meta = {**node.meta, CHUNK: chunk}
                new.meta.pop(LAYER, None)
                copies[node] = new
        for node in side:
            node.replace_all_uses_with(copies[node],
                                       delete_user_cb=lambda user: user.meta[CHUNK] == chunk)
        moved.extend(side)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(_ancestry(moved), key=pos.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _ancestry(nodes: list[fx.Node]) -> set[fx.Node]:
    """``nodes`` and every node they are computed from, placeholders aside."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen and node.op != "placeholder":
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen

