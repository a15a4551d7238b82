"""Rewrite pass 3: cut the graph into pipeline stages (contiguous layers).

A "stage" here is a model chunk of ``Plan.stage_layers``: pp of them (GPipe, 1F1B) or pp·v
(interleaved 1F1B, chunk c on pipeline rank c % pp, :func:`rank_chunks`).

Every node carries ``meta["autopar_stage"]`` (set from the plan's stage boundaries before
the TP pass; nodes inserted by later passes inherit it from the node they follow), and
``torch.fx.passes.split_module`` turns the graph into one GraphModule per stage. A stage
must take exactly one tensor (the first stage: the tokens; later stages: the activation
(b, s, h)) and return one: that is what the pipeline schedule sends between ranks.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.split_module import split_module

__all__ = ["annotate_stages", "split_stages", "rank_chunks"]


def annotate_stages(traced, stage_layers: list[list[int]]) -> None:
    """Set ``autopar_stage`` / ``autopar_layer`` on every node of ``traced.gm``."""
    stage_of_layer = {l: i for i, (lo, hi) in enumerate(stage_layers) for l in range(lo, hi)}
    last = len(stage_layers) - 1
    for node in traced.gm.graph.nodes:
        info = traced.nodes[node.name]
        if info.section == "layer":
            node.meta["autopar_layer"] = info.layer
            node.meta["autopar_stage"] = stage_of_layer[info.layer]
        else:
            node.meta["autopar_stage"] = 0 if info.section == "pre" else last


def split_stages(gm: fx.GraphModule, root, pp: int) -> list[fx.GraphModule]:
    """Split ``gm`` into ``pp`` stage GraphModules (index = stage, i.e. chunk, index; pass
    pp·v for interleaved plans).

    Raises NotImplementedError when a stage would take or return more than one tensor.
    """
    if pp == 1:
        return [gm]
    for node in gm.graph.nodes:
        if "autopar_stage" not in node.meta:
            raise ValueError(f"node {node.name} has no pipeline stage; annotate_stages first")
    split = split_module(gm, root, lambda n: n.meta["autopar_stage"], keep_original_order=True)
    stages = [getattr(split, f"submod_{i}") for i in range(pp)]
    for i, stage in enumerate(stages):
        inputs = [n.name for n in stage.graph.nodes if n.op == "placeholder"]
        out = next(n for n in stage.graph.nodes if n.op == "output").args[0]
        if len(inputs) != 1 or isinstance(out, (tuple, list)):
            raise NotImplementedError(
                f"pipeline stage {i} takes {inputs} and returns {out}; autopar's pipeline "
                "sends exactly one tensor between stages, so layers must read only the "
                "previous layer's output (compute masks/positions inside the layer)")
    return stages


def rank_chunks(stages: list, pp: int, rank: int) -> list:
    """The chunks pipeline rank ``rank`` runs: stages[rank], stages[rank + pp], ... (the
    round-robin of interleaved 1F1B; one stage when len(stages) == pp)."""
    return stages[rank::pp]
