"""The modules of a rank's program that hold a shard of a user's module, as the TP rewrite
(:mod:`autopar.rewrite.tensor_parallel`) inserts them: a shard of GPT-2's ``Conv1D``, the
reordering of a fused projection's blocks, and a row-parallel Linear's bias added after
the reduction."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["Conv1DShard", "BlockOrder", "BiasAdd"]


class Conv1DShard(nn.Module):
    """A shard of GPT-2's ``Conv1D`` (weight (in, out)): ``x @ weight (+ bias)`` over the
    last dim, computed as ``Conv1D`` does (``addmm`` on the flattened tokens)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mm(flat, self.weight) if self.bias is None else torch.addmm(self.bias, flat, self.weight)
        return out.reshape(*x.shape[:-1], self.weight.shape[1])


class BlockOrder(nn.Module):
    """Reorder ``dim`` between the natural order of a fused projection's output (blocks
    ``[B0 | B1 | ...]``, full sizes ``blocks``) and the *blocked* order in which rank r's
    shard ``[B0_r | B1_r | ...]`` is the r-th contiguous chunk (``to_blocked``), or back.
    A local permutation: what makes a gather from / a scatter into a fused projection's
    shards exact."""

    def __init__(self, blocks: tuple[int, ...], tp: int, dim: int, to_blocked: bool) -> None:
        super().__init__()
        self.blocks, self.tp, self.dim, self.to_blocked = tuple(blocks), tp, dim, to_blocked

    def extra_repr(self) -> str:
        return f"blocks={self.blocks}, tp={self.tp}, dim={self.dim}, to_blocked={self.to_blocked}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = [b // self.tp for b in self.blocks]
        if self.to_blocked:
            parts = [p.chunk(self.tp, self.dim) for p in x.split(list(self.blocks), self.dim)]
            return torch.cat([parts[k][r] for r in range(self.tp) for k in range(len(local))], self.dim)
        ranks = [c.split(local, self.dim) for c in x.chunk(self.tp, self.dim)]
        return torch.cat([ranks[r][k] for k in range(len(local)) for r in range(self.tp)], self.dim)


class BiasAdd(nn.Module):
    """``x + bias``: a row-parallel Linear's bias, added once after the all-reduce or
    reduce-scatter (adding it on every rank before the reduction would count it t times).
    When x is sharded along its last dim, this rank's slice [start, start + n) of the bias."""

    def __init__(self, bias: nn.Parameter, start: int = 0, size: int | None = None) -> None:
        super().__init__()
        self.bias = bias
        self.start, self.size = start, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size is None:
            return x + self.bias
        return x + self.bias[self.start:self.start + self.size]
