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

__all__ = ["gather_full"]


def gather_full(pm, pick: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``pick(p)`` of every local parameter (the parameter, its gradient, ...), made whole
    and keyed by the original model's state-dict keys, on every rank (CPU tensors).

    pm: a :class:`~autopar.runtime.parallelize.ParallelizedModel` (``groups``,
        ``stage_module``, ``shards``: local name -> ShardSpec, ``tied_aliases``).
    Each tensor is all-gathered over DP (ZeRO-3's DTensor shards) and over TP along its
    split dim (``ShardSpec.dim``), then TP rank 0 / DP rank 0 of every pipeline rank
    contributes its chunks' tensors; tied aliases (e.g. ``lm_head.weight``) repeat their
    canonical tensor. Collective over the whole world: every rank must call it.
    """
    g = pm.groups
    local: dict[str, torch.Tensor] = {}
    params = dict(pm.stage_module.named_parameters())
    for name, spec in sorted(pm.shards.items()):
        t = full_tensor(pick(params[name]).detach())  # ZeRO-3: all-gathered over DP
        if spec.dim is not None and g.tp > 1:
            parts = [torch.empty_like(t) for _ in range(g.tp)]
            dist.all_gather(parts, t.contiguous(), group=g.tp_group)
            t = spec.whole(parts)
        local[spec.key] = t.cpu().clone()
    gathered: list = [None] * g.world_size
    dist.all_gather_object(gathered, local if g.tp_rank == 0 and g.dp_rank == 0 else {})
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    for alias, canonical in pm.tied_aliases.items():
        if canonical in full:
            full[alias] = full[canonical]
    return full
