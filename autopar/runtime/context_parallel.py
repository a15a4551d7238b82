"""Context-parallel attention and the sequence split it runs on (the record:
:mod:`autopar.techniques.context_parallel`).

Each CP rank holds 2 of the 2·cp chunks of every sequence, chunks i and 2cp−1−i in that
order (:func:`shard_sequence`). Causal attention over the whole sequence is computed as
Llama 3 trained at 128K tokens (arXiv:2407.21783, section 3.3.2): the keys and values of
the cp ranks are all-gathered (backward: their gradients reduce-scattered, each rank's
queries having read every rank's keys), put back in sequence order, and each local query
chunk attends the keys up to its own last token under a lower-right causal mask::

    q (b, h, s/cp, d)   k, v (b, h_kv, s/cp, d)       per rank, chunks (i, 2cp−1−i)
      ──all-gather k, v──▶ (b, h_kv, s, d) in sequence order
      chunk j of q (b, h, s/2cp, d) × keys [0, (j+1)·s/2cp) ──▶ out chunk j
    out (b, h, s/cp, d)

Public torch only: the all-gather / reduce-scatter pair is
:func:`autopar.runtime.tp_ops.gather_to_tp_region_with_partial_grad` (any group), the
attention :func:`torch.nn.functional.scaled_dot_product_attention` with a boolean mask
(grouped-query attention by its ``enable_gqa``), so a torch upgrade changes nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime.tp_ops import Group, gather_to_tp_region_with_partial_grad, group_size
from autopar.techniques.context_parallel import cp_problem, sequence_chunks

__all__ = ["shard_sequence", "unshard_sequence", "context_parallel_attention"]


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``x``: chunks cp_rank and 2cp−1−cp_rank of the 2·cp equal
    chunks along ``dim``, concatenated. x: (..., s, ...) -> (..., s/cp, ...), e.g. input ids
    (b, s) -> (b, s/cp). Raises ValueError unless 2·cp divides s."""
    if cp == 1:
        return x
    problem = cp_problem(cp, x.shape[dim])
    if problem:
        raise ValueError(problem)
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[j] for j in sequence_chunks(cp, cp_rank)], dim)


def unshard_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: ``parts[i]`` is CP rank i's (..., s/cp, ...);
    returns (..., s, ...) in sequence order."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        for j, chunk in zip(sequence_chunks(cp, rank), part.chunk(2, dim)):
            chunks[j] = chunk
    return torch.cat(chunks, dim)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: Group, *, scale: float | None = None,
                               enable_gqa: bool = False) -> torch.Tensor:
    """Causal scaled-dot-product attention over the whole sequence for this CP rank's
    queries (module docstring): what ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True)`` gives on the unsplit sequence, restricted to this rank's tokens.

    q: (b, h, s/cp, d), k and v: (b, h_kv, s/cp, d), each this rank's chunks
    (:func:`shard_sequence` along dim 2) -> (b, h, s/cp, d). ``group``: the CP group (None:
    the world; one rank: plain causal SDPA). ``scale``, ``enable_gqa``: as SDPA's.

    Raises ValueError unless q, k and v have the same even local length (two chunks).
    """
    cp = group_size(group)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=enable_gqa)
    if q.shape[2] % 2 or k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"context-parallel attention needs q, k, v of the same even local "
                         f"length (two chunks per rank), got {q.shape[2]}, {k.shape[2]}, "
                         f"{v.shape[2]}")
    c = q.shape[2] // 2  # tokens per chunk
    # gathered in rank order along the sequence: rank i's (b, h_kv, s/cp, d), then in order
    keys, values = (unshard_sequence(gather_to_tp_region_with_partial_grad(t, group, 2)
                                     .chunk(cp, 2), dim=2) for t in (k, v))
    outs = []
    for local, j in enumerate(sequence_chunks(cp, dist.get_rank(group))):
        end = (j + 1) * c  # the chunk's queries see keys [0, end)
        rows = torch.arange(j * c, end, device=q.device)[:, None]
        mask = rows >= torch.arange(end, device=q.device)[None, :]  # (c, end), lower right
        outs.append(F.scaled_dot_product_attention(
            q[:, :, local * c:(local + 1) * c], keys[:, :, :end], values[:, :, :end],
            attn_mask=mask, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(outs, 2)
