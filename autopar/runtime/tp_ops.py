"""Tensor-parallel operators: one public function per region transition, autograd-aware.

Megatron's conjugate operators (Shoeybi et al. 2019, "Megatron-LM", section 3, Fig. 3):
``f`` is the identity in forward and an all-reduce in backward; ``g`` is an all-reduce in
forward and the identity in backward. In the MLP ``Z = GELU(X A) B`` with ``A``
column-split and ``B`` row-split over t ranks::

    X ──f──▶ X A_i ──GELU──▶ Y_i B_i ──g──▶ Z = Σ_i Y_i B_i
    (b, s, h)    (b, s, 4h/t)      (b, s, h) partial    (b, s, h)

``f`` (:func:`copy_to_tp_region`) makes the replicated input's gradient whole (each rank
only sees the part of dL/dX that flows through its columns); ``g``
(:func:`reduce_from_tp_region`) sums the row-split partial outputs. Gather and scatter
along a dimension (:func:`gather_from_tp_region`, :func:`scatter_to_tp_region`) are their
relatives for split activations: gather forward ↔ take-my-slice backward, and the reverse.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2, Fig. 6) replaces ``g`` by ``ḡ``
(:func:`reduce_scatter_to_tp_region`: reduce-scatter along the sequence in forward,
all-gather in backward) and ``f`` by ``f̄`` (:func:`gather_to_tp_region_with_partial_grad`:
all-gather forward, reduce-scatter of the partial gradient backward).

Each operator takes its ``group`` (None: the world) and is the identity both ways when the
group has one rank: that shortcut is written once, in :func:`_apply`. Every rank must pass
the same shape (gloo has no uneven all-gather). This mirrors Megatron-Core's
``tensor_parallel/mappings.py``; :mod:`autopar.runtime.tp_modules` wraps each function in
an ``nn.Module`` so that the rewritten ``torch.fx`` program shows it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.compat import all_gather_single, reduce_scatter_single

__all__ = ["Group", "group_size", "copy_to_tp_region", "reduce_from_tp_region",
           "gather_from_tp_region", "scatter_to_tp_region", "reduce_scatter_to_tp_region",
           "gather_to_tp_region_with_partial_grad"]

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Ranks in ``group`` (None = the world); 1 when torch.distributed is not initialised."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


# ------------------------------------------------------------------ primitives
def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of ``x`` over ``group`` in a fresh tensor (the input is not modified)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order: (.., n, ..) -> (.., t*n, ..)."""
    t = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()  # (n, ...)
    out = front.new_empty((t * front.shape[0], *front.shape[1:]))  # (t*n, ...), rank-major
    all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _check_divisible(x: torch.Tensor, dim: int, t: int, what: str) -> None:
    if x.shape[dim] % t != 0:
        raise ValueError(f"cannot {what} dim {dim} of size {x.shape[dim]} evenly over {t} ranks "
                         f"(gloo has no uneven all-gather); make that size a multiple of {t}")


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over ``group``, keeping this rank's 1/t slice along ``dim``: (.., t*n, ..) -> (.., n, ..).

    Raises ValueError if t does not divide ``x.shape[dim]``.
    """
    t = dist.get_world_size(group)
    _check_divisible(x, dim, t, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()  # (t*n, ...), rank-major chunks
    out = front.new_empty((front.shape[0] // t, *front.shape[1:]))
    reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


def _my_slice(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's 1/t slice of ``x`` along ``dim``; raises ValueError if t does not divide it."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    _check_divisible(x, dim, t, "split")
    n = x.shape[dim] // t
    return x.narrow(dim, r * n, n).contiguous()


# ------------------------------------------------------------------ autograd Functions
# Each Function's forward and backward are the two halves of one operator; they run only
# for t > 1 (see _apply). ``ctx.dim`` is normalised to a non-negative dim.

class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim % x.dim()
        return _all_gather(x, ctx.dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _my_slice(grad, ctx.dim, ctx.group), None, None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim % x.dim()
        return _my_slice(x, ctx.dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim % x.dim()
        return _reduce_scatter(x, ctx.dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherToTPRegionWithPartialGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim % x.dim()
        return _all_gather(x, ctx.dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def _apply(function: type[torch.autograd.Function], x: torch.Tensor, group: Group,
           *args: int) -> torch.Tensor:
    """``function.apply(x, group, *args)``, or ``x`` itself when ``group`` has one rank:
    with t = 1 every operator is the identity in forward and in backward."""
    if group_size(group) == 1:
        return x
    return function.apply(x, group, *args)


# ------------------------------------------------------------------ the operators
def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's ``f`` (Shoeybi et al. 2019, section 3, Fig. 3a): identity forward,
    all-reduce (sum) of the gradient backward. Enters a column-parallel region.

    x: replicated, any shape, e.g. (b, s, h) -> the same tensor. Backward all-reduces
    (b, s, h) over ``group``.
    """
    return _apply(_CopyToTPRegion, x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's ``g`` (Shoeybi et al. 2019, section 3, Fig. 3a): all-reduce (sum)
    forward, identity backward. Leaves a row-parallel region.

    x: this rank's partial sum (b, s, h) -> the full sum (b, s, h), the same on every rank.
    """
    return _apply(_ReduceFromTPRegion, x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """All-gather along ``dim`` forward (rank order); backward keeps this rank's slice of
    the gradient (no communication). E.g. column-split logits (b, s, V/t) -> (b, s, V).

    x: (..., n, ...) with the same shape on every rank -> (..., t*n, ...).
    """
    return _apply(_GatherFromTPRegion, x, group, dim)


def scatter_to_tp_region(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Keep this rank's slice along ``dim`` forward (no communication); all-gather the
    gradient backward. The conjugate of :func:`gather_from_tp_region`.

    x: replicated (..., t*n, ...) -> (..., n, ...). Raises ValueError if t does not divide
    ``x.shape[dim]``.
    """
    return _apply(_ScatterToTPRegion, x, group, dim)


def reduce_scatter_to_tp_region(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sequence-parallel ``ḡ`` (Korthikanti et al. 2022, section 4.2.2, Fig. 6):
    reduce-scatter along ``dim`` forward, all-gather of the gradient backward. Leaves a
    row-parallel region into a sequence-parallel one.

    x: partial sum (b, s, h) -> this rank's slice of the full sum, (b, s/t, h) for dim 1.
    Raises ValueError if t does not divide ``x.shape[dim]``.
    """
    return _apply(_ReduceScatterToTPRegion, x, group, dim)


def gather_to_tp_region_with_partial_grad(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sequence-parallel ``f̄`` (Korthikanti et al. 2022, section 4.2.2, Fig. 6): all-gather
    along ``dim`` forward, reduce-scatter of the gradient backward, for a consumer whose
    input gradient is partial (a column-parallel Linear). Equals an all-gather followed by
    ``f`` (all-reduce backward, then the gather's slice) at half the backward bytes.

    x: (b, s/t, h) -> (b, s, h) for dim 1; backward (b, s, h) partial -> (b, s/t, h) summed.
    """
    return _apply(_GatherToTPRegionWithPartialGrad, x, group, dim)
