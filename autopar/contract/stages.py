"""Layers per pipeline chunk: which layers a pipeline rank runs (:func:`rank_layers`) and
the even splits hand layouts use (:func:`equal_chunks`, :func:`even_stage_layers`).

``Plan.stage_layers`` holds one [first, last) per model chunk, in chunk order; with v
chunks per rank there are pp·v chunks, and the schedule's record places them
(:meth:`~autopar.techniques.pipeline_schedules.PipelineSchedule.chunk_rank`: chunk c on
pipeline rank c % pp, Megatron-LM's round-robin, Narayanan et al. 2021, §2.2; or the V of
ZB-V, rank r holding chunks r and 2pp - 1 - r). Pure Python: the plan, the planner, the
rewrite and the report share it.
"""

from __future__ import annotations

from autopar.techniques.pipeline_schedules import pipeline_schedule

__all__ = ["rank_layers", "equal_chunks", "even_stage_layers"]


def rank_layers(stage_layers: list[list[int]], pp: int, rank: int, *, schedule: str) -> list[int]:
    """Layer indices pipeline rank ``rank`` runs under ``schedule``: those of the chunks
    its record places there (``rank_chunks``; round-robin: chunks rank, rank + pp, ...),
    ascending. v = 1: ``range(*stage_layers[rank])``."""
    chunks = pipeline_schedule(schedule).rank_chunks(pp, len(stage_layers), rank)
    return [l for c in chunks for l in range(*stage_layers[c])]


def equal_chunks(num_layers: int, num_chunks: int) -> list[list[int]]:
    """``num_chunks`` equal [first, last) chunks of L layers (interleaved 1F1B: pp·v chunks
    of L/(pp·v) layers, as Megatron-LM requires). ValueError when L % num_chunks != 0."""
    if num_layers % num_chunks:
        raise ValueError(f"{num_layers} layers do not split into {num_chunks} equal chunks; "
                         "choose pp*virtual_stages dividing the layer count")
    size = num_layers // num_chunks
    return [[c * size, (c + 1) * size] for c in range(num_chunks)]


def even_stage_layers(num_layers: int, pp: int, virtual_stages: int = 1) -> list[list[int]]:
    """Megatron-LM's split of L layers over p pipeline ranks (hand layouts, ``evaluate``):
    v = 1, contiguous stages of L // p layers, the first L % p stages one more (the CP-SAT
    model's ``even_stages`` rule; the embedding sits on stage 0 and the head on stage
    p - 1, outside the count); v > 1, :func:`equal_chunks` of L / (p·v) layers. Raises
    ValueError when p > L or, interleaved, p·v does not divide L."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} pipeline stages cannot each hold one of {num_layers} "
                         "layers; choose pp <= the layer count")
    if virtual_stages > 1:
        return equal_chunks(num_layers, pp * virtual_stages)
    bounds, start = [], 0
    for i in range(pp):
        count = num_layers // pp + (1 if i < num_layers % pp else 0)
        bounds.append([start, start + count])
        start += count
    return bounds
