"""Megatron-LM's ``--pipeline-model-parallel-layout`` strings, read and written.

A layout names the p·v pipeline stages of a model in order, separated by ``|``: ``t`` a
transformer layer, ``E`` the embedding, ``L`` the loss, ``x*k`` and ``(..)*k`` repeats
(megatron-core's ``PipelineParallelLayerLayout``, core_v0.16.1). autopar reads the number
of transformer layers per stage and writes stages with the embedding on the first and the
loss on the last.
"""

from __future__ import annotations

import re

__all__ = ["parse_pp_layout", "pp_layout"]


def parse_pp_layout(text: str, num_layers: int, pp: int) -> list[int]:
    """Transformer layers per stage of ``--pipeline-model-parallel-layout`` ``text`` over p =
    ``pp`` ranks: p·v stages in model order, stage i on rank i % p as virtual stage i // p
    (megatron-core's ``PipelineParallelLayerLayout``; autopar's chunk order). Raises
    ValueError (a stage count that is not a multiple of p, a count that does not add up to
    ``num_layers``, the embedding not on the first stage or the loss not on the last, a
    symbol other than E, t, L)."""
    expanded = text.replace(",", "").replace(" ", "")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(expanded):
        expanded = group.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
    expanded = re.sub(r"([EtL])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), expanded)
    stages = expanded.split("|")
    if expanded.endswith("|") and len(stages) % pp == 1 and stages[-1] == "":
        stages = stages[:-1]
    if len(stages) % pp or set(expanded) - set("EtL|"):
        raise ValueError(f"--pipeline-model-parallel-layout {text!r}: expected a multiple of "
                         f"pp={pp} stages of E, t and L separated by '|' (autopar reads "
                         f"transformer layers, the embedding and the loss), got {len(stages)}")
    if "E" not in stages[0] or "L" not in stages[-1] or expanded.count("E") != 1 \
            or expanded.count("L") != 1:
        raise ValueError(f"--pipeline-model-parallel-layout {text!r}: autopar places the "
                         "embedding (E) on the first stage and the loss (L) on the last")
    counts = [stage.count("t") for stage in stages]
    if sum(counts) != num_layers:
        raise ValueError(f"--pipeline-model-parallel-layout {text!r} holds {sum(counts)} "
                         f"transformer layers, --num-layers is {num_layers}")
    return counts


def pp_layout(counts: list[int]) -> str:
    """``--pipeline-model-parallel-layout`` of stages with ``counts`` layers each (the
    embedding on the first, the loss on the last): e.g. [3, 4, 4, 5] -> "Et*3|t*4|t*4|t*5L"."""
    stages = [f"t*{n}" if n else "" for n in counts]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)
