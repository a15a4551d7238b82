"""The ``nn.Module`` forms of the TP operators, as the TP rewrite pass inserts them.

Each module calls one function of :mod:`autopar.runtime.tp_ops`, and that function's name
is the operator's only name: the module class is its CamelCase, and the rewriter names the
inserted ``call_module`` node after it, so ``print(gm.code)`` reads like the program::

    copy_to_tp_region_3 = self.copy_to_tp_region_3(layer_norm_1)
    linear_tp = self.linear_tp(copy_to_tp_region_3)            # column shard
    ...
    reduce_from_tp_region_5 = self.reduce_from_tp_region_5(linear_1_tp)

``forward_comm`` / ``backward_comm`` state which payload kind of
:data:`autopar.contract.plan.COMM_KINDS` the operator hands to its collective in each direction
(None: no communication); :class:`autopar.runtime.stats.CommMeter` measures them by
process group and collective, and the TP operator tests check the two agree.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import nn

from autopar.runtime import tp_ops
from autopar.runtime.tp_ops import Group, group_size

__all__ = ["TPOperator", "CopyToTPRegion", "ReduceFromTPRegion", "GatherFromTPRegion",
           "ScatterToTPRegion", "ReduceScatterToTPRegion", "GatherToTPRegionWithPartialGrad",
           "TP_OPERATORS"]


class TPOperator(nn.Module):
    """A TP operator holding its process group as a plain attribute (not a buffer) and,
    for the operators along a tensor dimension, that ``dim``.

    Subclasses set ``op`` (a :mod:`~autopar.runtime.tp_ops` function); ``name`` is derived
    from it and is the prefix of the fx nodes the rewriter inserts.
    """

    op: ClassVar[Callable[..., torch.Tensor]]
    name: ClassVar[str]
    forward_comm: ClassVar[str | None] = None
    backward_comm: ClassVar[str | None] = None
    takes_dim: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.op.__name__

    def __init__(self, group: Group, dim: int | None = None) -> None:
        super().__init__()
        if self.takes_dim != (dim is not None):
            raise TypeError(f"{type(self).__name__} takes "
                            f"{'a tensor dim' if self.takes_dim else 'no dim'}, got dim={dim!r}")
        self.group, self.dim = group, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return type(self).op(x, self.group)
        return type(self).op(x, self.group, self.dim)

    def extra_repr(self) -> str:
        dim = "" if self.dim is None else f", dim={self.dim}"
        return f"{self.name}, tp={group_size(self.group)}{dim}"


class CopyToTPRegion(TPOperator):
    """``f``: identity forward, all-reduce backward. x: (b, s, h) -> (b, s, h)."""

    op = staticmethod(tp_ops.copy_to_tp_region)
    backward_comm, takes_dim = "tp_all_reduce", False


class ReduceFromTPRegion(TPOperator):
    """``g``: all-reduce forward, identity backward. (b, s, h) partial -> (b, s, h)."""

    op = staticmethod(tp_ops.reduce_from_tp_region)
    forward_comm, takes_dim = "tp_all_reduce", False


class GatherFromTPRegion(TPOperator):
    """All-gather along ``dim`` forward, slice backward: (.., n, ..) -> (.., t*n, ..)."""

    op = staticmethod(tp_ops.gather_from_tp_region)
    forward_comm = "tp_all_gather"


class ScatterToTPRegion(TPOperator):
    """Slice along ``dim`` forward, all-gather backward: (.., t*n, ..) -> (.., n, ..)."""

    op = staticmethod(tp_ops.scatter_to_tp_region)
    backward_comm = "tp_all_gather"


class ReduceScatterToTPRegion(TPOperator):
    """Sequence-parallel ``ḡ`` along ``dim``: (.., t*n, ..) partial -> (.., n, ..)."""

    op = staticmethod(tp_ops.reduce_scatter_to_tp_region)
    forward_comm, backward_comm = "tp_reduce_scatter", "tp_all_gather"


class GatherToTPRegionWithPartialGrad(TPOperator):
    """Sequence-parallel ``f̄`` along ``dim``: (.., n, ..) -> (.., t*n, ..); backward
    reduce-scatters the partial gradient."""

    op = staticmethod(tp_ops.gather_to_tp_region_with_partial_grad)
    forward_comm, backward_comm = "tp_all_gather", "tp_reduce_scatter"


TP_OPERATORS: tuple[type[TPOperator], ...] = (
    CopyToTPRegion, ReduceFromTPRegion, GatherFromTPRegion, ScatterToTPRegion,
    ReduceScatterToTPRegion, GatherToTPRegionWithPartialGrad)
