"""Tensor-parallel collectives as autograd Functions, and the modules that hold them.

These are Megatron's conjugate operators (Shoeybi et al. 2019, "Megatron-LM",
section 3, Fig. 3): ``f`` is the identity in forward and an all-reduce in backward;
``g`` is an all-reduce in forward and the identity in backward. In the MLP
``Z = GELU(X A) B`` with ``A`` column-split and ``B`` row-split over t ranks::

    X ──f──▶ X A_i ──GELU──▶ Y_i B_i ──g──▶ Z = Σ_i Y_i B_i
    (b, s, h)    (b, s, 4h/t)      (b, s, h) partial    (b, s, h)

``f`` makes the replicated input's gradient whole (each rank only sees the part of
dL/dX that flows through its columns); ``g`` sums the row-split partial outputs.
Gather/scatter along a dimension are the sequence-parallel (and logits-gather)
relatives: gather forward ↔ take-my-slice backward, and the reverse. Sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2, Fig. 6) replaces g by ``ḡ``: reduce-scatter along the sequence in
forward, all-gather in backward (:class:`ReduceScatterToTP`), and f by its conjugate:
all-gather forward, reduce-scatter of the partial gradient backward
(:class:`GatherToPartialGradTP`).

Every operator takes its ``group`` and is a no-op when the group has one rank.
The ``TP*`` modules wrap them so that a rewritten ``torch.fx.GraphModule`` shows
them as ``call_module`` nodes and ``print(gm.code)`` reads like the distributed
program. Payload bytes, the size of each tensor this rank hands to a collective, are
recorded into an optional :class:`CommCounter` (all-reduce: the reduced tensor;
all-gather: this rank's shard; p2p: what this rank sends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.plan import COMM_KINDS  # the payload kinds predictions and measurements share
Group = dist.ProcessGroup | None


@dataclass
class CommCounter:
    """Payload bytes per kind of communication, summed over calls.

    Attributes:
        bytes: kind -> bytes, kinds in :data:`COMM_KINDS`.
    """

    bytes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in COMM_KINDS})

    def add(self, kind: str, nbytes: int) -> None:
        """Add ``nbytes`` to ``kind``. Raises ValueError for an unknown kind."""
        if kind not in COMM_KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; use one of {COMM_KINDS}")
        self.bytes[kind] += int(nbytes)

    def total(self) -> int:
        """All bytes recorded, every kind together."""
        return sum(self.bytes.values())

    def reset(self) -> None:
        """Set every kind back to 0."""
        for kind in COMM_KINDS:
            self.bytes[kind] = 0


def group_size(group: Group) -> int:
    """Ranks in ``group`` (None = the world); 1 when torch.distributed is not initialised."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _record(counter: CommCounter | None, kind: str, t: torch.Tensor) -> None:
    if counter is not None:
        counter.add(kind, t.numel() * t.element_size())


def _all_reduce(x: torch.Tensor, group: Group, counter: CommCounter | None) -> torch.Tensor:
    """Sum of ``x`` over ``group`` in a fresh tensor (the input is not modified)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    _record(counter, "tp_all_reduce", out)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: Group, counter: CommCounter | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order.

    Every rank must pass the same shape (gloo has no uneven all-gather).
    x: (..., n, ...) -> (..., t*n, ...).
    """
    t = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()  # (n, ...)
    out = front.new_empty((t * front.shape[0], *front.shape[1:]))  # (t*n, ...), rank-major
    dist.all_gather_single(out, front, group=group)
    _record(counter, "tp_all_gather", front)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group, counter: CommCounter | None) -> torch.Tensor:
    """Sum over ``group``, keeping this rank's 1/t slice along ``dim``: (.., t*n, ..) -> (.., n, ..).

    Raises ValueError if t does not divide ``x.shape[dim]``.
    """
    t = dist.get_world_size(group)
    if x.shape[dim] % t != 0:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {t} ranks; "
                         f"make that size a multiple of {t}")
    front = x.movedim(dim, 0).contiguous()  # (t*n, ...), rank-major chunks
    out = front.new_empty((front.shape[0] // t, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=group)
    _record(counter, "tp_reduce_scatter", front)
    return out.movedim(0, dim).contiguous()


def _my_slice(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's 1/t slice of ``x`` along ``dim``; raises ValueError if t does not divide it."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[dim]
    if n % t != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {n} evenly over {t} ranks (gloo has no uneven "
            f"all-gather); make that size a multiple of {t}"
        )
    return x.narrow(dim, r * (n // t), n // t).contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron ``f``: identity forward, all-reduce(sum) of the gradient backward.

    ``CopyToTP.apply(x, group, counter)``; x: any shape, returned as is (b, s, h).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, counter: CommCounter | None) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if group_size(ctx.group) == 1:
            return grad, None, None
        return _all_reduce(grad, ctx.group, ctx.counter), None, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron ``g``: all-reduce(sum) forward, identity backward.

    ``ReduceFromTP.apply(x, group, counter)``; x: partial sum (b, s, h) -> full sum (b, s, h).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, counter: CommCounter | None) -> torch.Tensor:
        if group_size(group) == 1:
            return x
        return _all_reduce(x, group, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class GatherFromTP(torch.autograd.Function):
    """All-gather along ``dim`` forward (rank order); backward keeps this rank's slice.

    ``GatherFromTP.apply(x, group, dim, counter)``; x: (..., n, ...) with the same shape on
    every rank -> (..., t*n, ...). E.g. column-split logits (b, s, V/t) -> (b, s, V).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, dim: int, counter: CommCounter | None
    ) -> torch.Tensor:
        dim = dim % x.dim()
        ctx.group, ctx.dim = group, dim
        if group_size(group) == 1:
            return x
        return _all_gather(x, dim, group, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if group_size(ctx.group) == 1:
            return grad, None, None, None
        return _my_slice(grad, ctx.dim, ctx.group), None, None, None


class ScatterToTP(torch.autograd.Function):
    """Take this rank's slice along ``dim`` forward; all-gather the gradient backward.

    ``ScatterToTP.apply(x, group, dim, counter)``; x: (..., t*n, ...) replicated ->
    (..., n, ...). Raises ValueError if t does not divide ``x.shape[dim]``.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, dim: int, counter: CommCounter | None
    ) -> torch.Tensor:
        dim = dim % x.dim()
        ctx.group, ctx.dim, ctx.counter = group, dim, counter
        if group_size(group) == 1:
            return x
        return _my_slice(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if group_size(ctx.group) == 1:
            return grad, None, None, None
        return _all_gather(grad, ctx.dim, ctx.group, ctx.counter), None, None, None


class ReduceScatterToTP(torch.autograd.Function):
    """Sequence-parallel ``ḡ``: reduce-scatter along ``dim`` forward, all-gather backward.

    ``ReduceScatterToTP.apply(x, group, dim, counter)``; x: partial sum (b, s, h) ->
    this rank's slice of the full sum, e.g. (b, s/t, h) for dim 1.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, dim: int, counter: CommCounter | None
    ) -> torch.Tensor:
        dim = dim % x.dim()
        ctx.group, ctx.dim, ctx.counter = group, dim, counter
        if group_size(group) == 1:
            return x
        return _reduce_scatter(x, dim, group, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if group_size(ctx.group) == 1:
            return grad, None, None, None
        return _all_gather(grad, ctx.dim, ctx.group, ctx.counter), None, None, None


class GatherToPartialGradTP(torch.autograd.Function):
    """All-gather along ``dim`` forward for a consumer whose input gradient is partial (a
    column-parallel Linear): backward reduce-scatters that gradient. Equals an all-gather
    followed by f (all-reduce backward, then the gather's slice) at half the backward bytes.

    ``GatherToPartialGradTP.apply(x, group, dim, counter)``; x: (b, s/t, h) -> (b, s, h).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, dim: int, counter: CommCounter | None
    ) -> torch.Tensor:
        dim = dim % x.dim()
        ctx.group, ctx.dim, ctx.counter = group, dim, counter
        if group_size(group) == 1:
            return x
        return _all_gather(x, dim, group, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if group_size(ctx.group) == 1:
            return grad, None, None, None
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.counter), None, None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of vocabulary-split logits without gathering them (Megatron-LM's
    ``vocab_parallel_cross_entropy``, Shoeybi et al. 2019 section 3).

    ``VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start)``: logits (b, s,
    V/t), this rank's columns [vocab_start, vocab_start + V/t) of the (b, s, V) logits;
    targets (b, s) int64 in [0, V) -> per-token loss (b, s) float32, the same on every rank.
    Forward all-reduces three (b, s) fp32 tensors over ``group`` (max, target logit, sum of
    exponentials); backward needs no communication: softmax - one-hot on this rank's columns.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Group,
                vocab_start: int) -> torch.Tensor:
        x = logits.float()
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
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        inside = (~outside).to(g.dtype)
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1))  # - one-hot
        return (g * grad.unsqueeze(-1)).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, group: Group,
                                 vocab_start: int) -> torch.Tensor:
    """Mean token cross-entropy of vocabulary-split logits (b, s, V/t); see
    :class:`VocabParallelCrossEntropy`. Returns a float32 scalar."""
    return VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start).mean()


class _TPModule(nn.Module):
    """Holds the process group as a plain attribute (not a buffer) and an optional counter."""

    op_name = ""

    def __init__(self, group: Group, counter: CommCounter | None = None) -> None:
        super().__init__()
        self.group = group
        self.counter = counter

    def extra_repr(self) -> str:
        return f"op={self.op_name}, tp={group_size(self.group)}"


class TPCopy(_TPModule):
    """``f`` (:class:`CopyToTP`): identity forward, all-reduce backward. x: (b, s, h) -> (b, s, h)."""

    op_name = "copy_fwd/all_reduce_bwd (f)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CopyToTP.apply(x, self.group, self.counter)


class TPAllReduce(_TPModule):
    """``g`` (:class:`ReduceFromTP`): all-reduce forward, identity backward. (b, s, h) -> (b, s, h)."""

    op_name = "all_reduce_fwd/copy_bwd (g)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ReduceFromTP.apply(x, self.group, self.counter)


class _TPDimModule(_TPModule):
    """A TP operator along one tensor dimension ``dim``."""

    def __init__(self, group: Group, dim: int, counter: CommCounter | None = None) -> None:
        super().__init__(group, counter)
        self.dim = dim

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dim={self.dim}"


class TPAllGather(_TPDimModule):
    """:class:`GatherFromTP` along ``dim``: (..., n, ...) -> (..., t*n, ...)."""

    op_name = "all_gather_fwd/slice_bwd"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GatherFromTP.apply(x, self.group, self.dim, self.counter)


class TPScatter(_TPDimModule):
    """:class:`ScatterToTP` along ``dim``: (..., t*n, ...) -> (..., n, ...)."""

    op_name = "slice_fwd/all_gather_bwd"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScatterToTP.apply(x, self.group, self.dim, self.counter)


class TPReduceScatter(_TPDimModule):
    """:class:`ReduceScatterToTP` (sequence-parallel ḡ) along ``dim``: (.., t*n, ..) partial -> (.., n, ..)."""

    op_name = "reduce_scatter_fwd/all_gather_bwd (g-bar)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ReduceScatterToTP.apply(x, self.group, self.dim, self.counter)


class TPGatherToPartialGrad(_TPDimModule):
    """:class:`GatherToPartialGradTP` (sequence-parallel f-bar) along ``dim``: (.., n, ..) -> (.., t*n, ..)."""

    op_name = "all_gather_fwd/reduce_scatter_bwd (f-bar)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GatherToPartialGradTP.apply(x, self.group, self.dim, self.counter)


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of a (V, h) embedding table (Megatron's VocabParallelEmbedding).

    ``weight``: Parameter (V/t, h). forward(idx: (b, s) int64) -> (b, s, h): the rows of the
    tokens this rank owns, zeros for the others, i.e. a partial sum that a
    :class:`TPAllReduce` after it completes. A given ``nn.Parameter`` is kept as is (so a
    tied head on the same stage can share it); any other tensor is wrapped.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"embedding shard must be 2-D (V/t, h), got shape {tuple(weight.shape)}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.vocab_start = int(vocab_start)
        self.vocab_end = self.vocab_start + weight.shape[0]

    @classmethod
    def from_full(cls, full_weight: torch.Tensor, tp_rank: int, tp: int) -> VocabParallelEmbedding:
        """Shard ``tp_rank`` of a full (V, h) table (copied). Raises ValueError unless t | V."""
        vocab = full_weight.shape[0]
        if vocab % tp != 0:
            raise ValueError(f"vocabulary {vocab} is not divisible by tp={tp}; pad V to a multiple of {tp}")
        rows = vocab // tp
        shard = full_weight.detach()[tp_rank * rows : (tp_rank + 1) * rows].clone()
        return cls(shard, tp_rank * rows)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), h={self.weight.shape[1]}"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)  # (b, s)
        local = (idx - self.vocab_start).masked_fill(outside, 0)  # (b, s) in [0, V/t)
        out = F.embedding(local, self.weight)  # (b, s, h)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)
