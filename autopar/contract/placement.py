"""How a tensor lives on the t ranks of a tensor-parallel group, and the plan's strategy keys.

A :data:`Placement` is one of

* :class:`Replicate` (``"R"``): every rank holds the whole tensor;
* :class:`Shard` (``"S<d>"``): rank r holds the r-th of t equal slices along dim d;
* :class:`Partial` (``"P"``): the true tensor is the sum over the t ranks (a row-parallel
  Linear's output before Megatron's g, Shoeybi et al. 2019, section 3).

These are the placements of DTensor (``torch.distributed.tensor``) restricted to one mesh
axis; autopar keeps its own three small classes so that planning never imports DTensor.
:class:`ShardSpec` says where a rank's parameter comes from (the rewrite makes them, the
runtime's shard-only init and checkpoints read them).

A plan stores each node's tensor-parallel decision as a *strategy key*
``"<strategy name>:<output placement>"``, e.g. ``"column:S2"``, ``"row:P"``,
``"replicate:R"``; ``x.size(d)`` of a tensor sharded along d is the strategy
``"shape_S<d>"``. This module is the only code that reads or writes those strings: every
other module asks a :data:`Placement` for ``is_sharded`` / ``dim`` and a
:class:`StrategyKey` for ``name`` / ``output``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Union

if TYPE_CHECKING:
    import torch

__all__ = ["Placement", "Replicate", "Shard", "Partial", "REPLICATE", "PARTIAL", "ShardSpec",
           "parse_placement", "StrategyKey", "parse_strategy_key", "format_strategy_key",
           "shape_strategy_name"]


@dataclass(frozen=True)
class Replicate:
    """Every TP rank holds the whole tensor (``"R"``)."""

    is_replicated: ClassVar[bool] = True
    is_sharded: ClassVar[bool] = False
    is_partial: ClassVar[bool] = False
    dim: ClassVar[None] = None

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Rank r holds the r-th of t equal slices along ``dim`` (``"S<dim>"``, dim >= 0)."""

    dim: int
    is_replicated: ClassVar[bool] = False
    is_sharded: ClassVar[bool] = True
    is_partial: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard.dim must be a non-negative int, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S{self.dim}"


@dataclass(frozen=True)
class Partial:
    """The tensor is the sum of the ranks' tensors (``"P"``)."""

    is_replicated: ClassVar[bool] = False
    is_sharded: ClassVar[bool] = False
    is_partial: ClassVar[bool] = True
    dim: ClassVar[None] = None

    def __str__(self) -> str:
        return "P"


Placement = Union[Replicate, Shard, Partial]
REPLICATE = Replicate()
PARTIAL = Partial()


def parse_placement(text: str) -> Placement:
    """``"R"`` | ``"P"`` | ``"S<d>"`` -> the Placement (the inverse of ``str(placement)``).

    Raises ValueError for anything else.
    """
    if text == "R":
        return REPLICATE
    if text == "P":
        return PARTIAL
    if text[:1] == "S" and text[1:].isdigit():
        return Shard(int(text[1:]))
    raise ValueError(f"{text!r} is not a placement; expected 'R', 'P' or 'S<dim>'")


def shape_strategy_name(dim: int) -> str:
    """The strategy name of ``x.size(d)`` read from a tensor sharded along ``dim``
    (unique per dim, so that the node's strategy keys stay unique)."""
    return f"shape_{Shard(dim)}"


@dataclass(frozen=True)
class StrategyKey:
    """A plan's decision for one node: the strategy ``name`` and its ``output`` placement.

    name: "replicate" | "column" | "row" | "vocab" | "heads" | "sharded" |
        "vocab_parallel" | "shape_S<d>" (see :mod:`autopar.planner.strategies`).
    """

    name: str
    output: Placement

    @property
    def reads_size(self) -> bool:
        """True for ``x.size(d)`` of a sharded x (the rewriter multiplies it by t)."""
        return self.name.startswith("shape_")

    def __str__(self) -> str:
        return f"{self.name}:{self.output}"


def format_strategy_key(name: str, output: Placement) -> str:
    """``"<name>:<output placement>"``, the string a Plan stores (unique per node)."""
    return str(StrategyKey(name, output))


def parse_strategy_key(key: str) -> StrategyKey:
    """The inverse of :func:`format_strategy_key`. Raises ValueError for a malformed key."""
    name, sep, placement = key.rpartition(":")
    if not sep or not name:
        raise ValueError(f"{key!r} is not a strategy key '<name>:<placement>'")
    return StrategyKey(name, parse_placement(placement))


@dataclass(frozen=True)
class ShardSpec:
    """Where a local parameter comes from: ``key`` in the original state dict, split along
    ``dim`` into ``tp`` equal parts (dim None: replicated). ``blocks``: the sizes along
    ``dim`` of a fused projection's parts (q, k, v of a fused QKV Linear), each split
    into tp parts and rank r holding the r-th part of every block, in order (Megatron's
    layout of a fused QKV weight); empty: one contiguous split."""

    key: str
    dim: int | None = None
    blocks: tuple[int, ...] = ()

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's shard of the whole tensor ``full``."""
        import torch  # placement itself stays importable without torch

        if self.dim is None or tp == 1:
            return full
        pieces = full.split(list(self.blocks), self.dim) if self.blocks else (full,)
        return torch.cat([p.chunk(tp, self.dim)[rank] for p in pieces], self.dim)

    def whole(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's shard (``parts[r]`` of rank r)."""
        import torch

        if self.dim is None:
            return parts[0]
        if not self.blocks:
            return torch.cat(parts, self.dim)
        tp = len(parts)
        local = [b // tp for b in self.blocks]
        split = [p.split(local, self.dim) for p in parts]
        return torch.cat([split[r][k] for k in range(len(local)) for r in range(tp)], self.dim)
