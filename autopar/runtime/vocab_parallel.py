"""Vocabulary parallelism: the embedding split by rows and the cross-entropy of split logits.

Both follow Megatron-LM (Shoeybi et al. 2019, section 3): the (V, h) word embedding is
split into t row ranges of V/t tokens; each rank looks up the tokens it owns and writes
zeros for the others, so a :func:`~autopar.runtime.tp_ops.reduce_from_tp_region` after it
completes the lookup. The output layer shares (ties) the table; its logits stay split
(b, s, V/t), and the loss is computed from them with three all-reduces of (b, s) numbers
instead of an all-gather of b·s·V logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.runtime.tp_ops import Group

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of a (V, h) embedding table (Megatron's VocabParallelEmbedding).

    ``weight``: Parameter (V/t, h). forward(idx: (b, s) int64) -> (b, s, h): the rows of the
    tokens this rank owns, zeros for the others, i.e. a partial sum that a
    :class:`~autopar.runtime.tp_modules.ReduceFromTPRegion` after it completes. A given
    ``nn.Parameter`` is kept as is (so a tied head on the same pipeline rank can share it);
    any other tensor is wrapped. ``padding_idx``: the whole table's ``nn.Embedding``
    padding row (its gradient stays zero, as in ``F.embedding``), None if it has none.
    Raises ValueError unless ``weight`` is 2-D.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, padding_idx: int | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"embedding shard must be 2-D (V/t, h), got shape {tuple(weight.shape)}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.vocab_start = int(vocab_start)
        self.vocab_end = self.vocab_start + weight.shape[0]
        self.padding_idx = padding_idx
        owned = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self.local_padding_idx = padding_idx - self.vocab_start if owned else None

    @classmethod
    def from_full(cls, full_weight: torch.Tensor, tp_rank: int, tp: int,
                  padding_idx: int | None = None) -> VocabParallelEmbedding:
        """Shard ``tp_rank`` of a full (V, h) table (copied). Raises ValueError unless t | V."""
        vocab = full_weight.shape[0]
        if vocab % tp != 0:
            raise ValueError(f"vocabulary {vocab} is not divisible by tp={tp}; pad V to a multiple of {tp}")
        rows = vocab // tp
        shard = full_weight.detach()[tp_rank * rows : (tp_rank + 1) * rows].clone()
        return cls(shard, tp_rank * rows, padding_idx)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), h={self.weight.shape[1]}{pad}"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)  # (b, s)
        local = (idx - self.vocab_start).masked_fill(outside, 0)  # (b, s) in [0, V/t)
        out = F.embedding(local, self.weight, self.local_padding_idx)  # (b, s, h)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss of vocabulary-split logits; see :func:`vocab_parallel_cross_entropy`.

    Forward all-reduces three (b, s) fp32 tensors over ``group`` (max, target logit, sum of
    exponentials); backward needs no communication: softmax - one-hot on this rank's columns.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Group,
                vocab_start: int) -> torch.Tensor:
        x = logits.float()  # (b, s, V/t)
        row_max = x.max(dim=-1).values  # (b, s)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        n = x.shape[-1]
        outside = (targets < vocab_start) | (targets >= vocab_start + n)  # (b, s)
        local = (targets - vocab_start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        exp = x.exp()  # (b, s, V/t)
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target_logit  # (b, s)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        inside = (~outside).to(g.dtype)
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1))  # - one-hot
        return (g * grad.unsqueeze(-1)).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, group: Group,
                                 vocab_start: int) -> torch.Tensor:
    """Mean token cross-entropy of vocabulary-split logits (Megatron-LM's
    ``vocab_parallel_cross_entropy``, Shoeybi et al. 2019, section 3).

    logits: (b, s, V/t), this rank's columns [vocab_start, vocab_start + V/t) of the
    (b, s, V) logits; targets: (b, s) int64 in [0, V). Returns a float32 scalar, the same
    on every rank of ``group``. Communication: 3 all-reduces of (b, s) fp32 in forward.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start).mean()
