"""Whole tensors from a sharded program: the inverse of the TP rewrite and ZeRO-3 sharding.

Used by ``ParallelizedModel.full_state_dict`` (parameters) and by
:func:`autopar.verify.check.full_gradients` (gradients).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.runtime.fsdp import full_tensor

__all__ = ["gather_full", "whole_over_tp", "whole_over_ep"]


def whole_over_tp(t: torch.Tensor, spec, groups) -> torch.Tensor:
    """The whole tensor of TP-local ``t`` split as ``spec`` (a ShardSpec) says: all-gathered
    over ``groups.tp_group`` and joined (collective over TP when split; else ``t``)."""
    if spec.dim is None or groups.tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(groups.tp)]
    dist.all_gather(parts, t.contiguous(), group=groups.tp_group)
    return spec.whole(parts)


def whole_over_ep(t: torch.Tensor, groups) -> torch.Tensor:
    """All E experts of ``t`` (E/ep, ...), this rank's slice of an expert-parallel
    parameter: all-gathered over ``groups.ep_group`` and joined on dim 0 in EP-rank order
    (E, ...) (collective over EP; ``t`` when ep == 1)."""
    if groups.ep == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(groups.ep)]
    dist.all_gather(parts, t.contiguous(), group=groups.ep_group)
    return torch.cat(parts, 0)


def gather_full(pm, pick: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``pick(p)`` of every local parameter (the parameter, its gradient, ...), made whole
    and keyed by the original model's state-dict keys, on every rank (CPU tensors).

    pm: a :class:`~autopar.recipe.ParallelizedModel` (``groups``,
        ``stage_module``, ``shards``: local name -> ShardSpec, ``tied_aliases``).
    Each tensor is all-gathered over DP (ZeRO-3's DTensor shards) and over TP along its
    split dim (``ShardSpec.dim``), expert parameters over EP along dim 0
    (``pm.expert_slices``), then TP rank 0 / DP rank 0 of every pipeline rank
    contributes its chunks' tensors; tied aliases (e.g. ``lm_head.weight``) repeat their
    canonical tensor. Collective over the whole world: every rank must call it.
    """
    g = pm.groups
    local: dict[str, torch.Tensor] = {}
    params = dict(pm.stage_module.named_parameters())
    for name, spec in sorted(pm.shards.items()):
        t = full_tensor(pick(params[name]).detach())  # ZeRO-3: all-gathered over DP
        if name in getattr(pm, "expert_slices", {}):
            t = whole_over_ep(t, g)
        local[spec.key] = whole_over_tp(t, spec, g).cpu().clone()
    gathered: list = [None] * g.world_size
    dist.all_gather_object(gathered, local if g.tp_rank == 0 and g.dp_rank == 0 else {})
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    for alias, canonical in pm.tied_aliases.items():
        if canonical in full:
            full[alias] = full[canonical]
    return full
