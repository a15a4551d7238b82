"""One parameter's tensors whole over data parallelism: read out of, and written back into,
the ZeRO flat buffer or the FSDP2 shards. The layer under :mod:`autopar.runtime.checkpoint`.

A rank's parameter ``p`` is its tensor-parallel shard of an original weight (the TP-local
tensor, shape ``p.shape``). Over the d data-parallel ranks of its stage it lives in one of
two ways, and :func:`dp_state` returns the matching adapter:

* :class:`FlatState` (:class:`~autopar.runtime.zero.DistributedOptimizer`, ZeRO-0/1/2):
  ``p`` is a view of ``buffer[o:o + n]`` (n = p.numel()); DP rank r's optimizer owns the
  flat ranges ``shards`` (its shard of every bucket): for each, an fp32 master piece and
  optimizer states (AdamW's ``exp_avg``, ``exp_avg_sq``: (hi - lo,); ``step``: a scalar).
  ZeRO-0 owns the whole buffer as one range.
* :class:`ShardedState` (:class:`~autopar.runtime.fsdp.FullyShardedOptimizer`, ZeRO-3):
  ``p`` is a DTensor sharded on dim 0 over the DP mesh (``torch.chunk`` pieces, the last
  ones shorter or empty); its optimizer states are DTensors laid out the same way.

Reading (``param``/``states``) hands the whole tensor to one DP rank, ``owner`` (None on
the others); it is collective over the DP group: every DP rank of the stage calls it for
the same parameter, in the same order, with the same owner. Writing (``write_param``,
``write_states``) is local: each rank keeps its own piece of the whole tensor it is given.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.runtime.fsdp import FullyShardedOptimizer, full_tensor

__all__ = ["FlatState", "ShardedState", "dp_state"]

States = dict[str, torch.Tensor]  # optimizer state name -> tensor ("exp_avg", "step", ...)


def _check_tensors(states: dict, where: str) -> States:
    """The tensor-valued optimizer states (None entries, SGD's momentum-free buffer, dropped).
    Raises NotImplementedError for other values (a checkpoint holds tensors only)."""
    out = {}
    for name, value in states.items():
        if value is None:
            continue
        if not torch.is_tensor(value):
            raise NotImplementedError(f"optimizer state {name!r} of {where} is a "
                                      f"{type(value).__name__}, not a tensor; autopar "
                                      "checkpoints hold tensor-valued optimizer states only")
        out[name] = value
    return out


class FlatState:
    """ZeRO-0/1/2: parameters are views of ``opt.buffer``; this rank's master weights and
    optimizer states cover the flat ranges ``opt.shards`` (one per bucket from ZeRO-1 on,
    the whole buffer under ZeRO-0), ``opt.masters[j]`` and ``opt.shard_states()[j]`` covering
    shard j."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self.offset = {id(p): o for p, o in zip(opt.params, opt.offsets)}

    def _pieces(self, p: nn.Parameter) -> list[tuple[int, int, int]]:
        """(j, a, b): the parts [a, b) of p's buffer range that this rank's shard j owns."""
        o = self.offset[id(p)]
        return [(j, max(o, lo), min(o + p.numel(), hi)) for j, (lo, hi) in enumerate(self.opt.shards)
                if max(o, lo) < min(o + p.numel(), hi)]

    def _whole(self, flats: list[torch.Tensor], p: nn.Parameter, owner: int) -> torch.Tensor | None:
        """p's elements of the per-shard tensors ``flats`` (shard j: (hi_j - lo_j,)), whole
        (p.shape) on DP rank ``owner``, None elsewhere: each rank fills its parts of a zero
        tensor and the parts are summed onto the owner (one reduce of p.numel() elements
        over DP; none under ZeRO-0, where every rank holds everything)."""
        sharded = self.opt.sharded
        if not sharded and self.opt.dp_rank != owner:
            return None
        o = self.offset[id(p)]
        out = flats[0].new_zeros(p.numel())
        for j, a, b in self._pieces(p):
            lo = self.opt.shards[j][0]
            out[a - o:b - o] = flats[j][a - lo:b - lo]
        if sharded:
            dist.reduce(out, op=dist.ReduceOp.SUM, group=self.opt.group, group_dst=owner)
        return out.view(p.shape) if self.opt.dp_rank == owner else None

    def param(self, p: nn.Parameter, owner: int) -> torch.Tensor | None:
        """p's master value (fp32 under bf16 mixed precision), whole on DP rank ``owner``."""
        if id(p) not in self.offset:  # frozen: not in the buffer, the same on every rank
            return p.detach() if self.opt.dp_rank == owner else None
        return self._whole([m.detach() for m in self.opt.masters], p, owner)

    def states(self, p: nn.Parameter, owner: int) -> dict[str, torch.Tensor | None]:
        """p's optimizer states, whole on DP rank ``owner`` (None elsewhere): per-element
        ones shaped like p, scalars (AdamW's step) as they are. Empty before the first step."""
        per_shard = [_check_tensors(state, "a flat shard") for state in self.opt.shard_states()]
        mine = self.opt.dp_rank == owner
        out = {}
        for name, v in sorted(per_shard[0].items()) if per_shard else ():
            if v.dim() > 0:
                out[name] = self._whole([st[name] for st in per_shard], p, owner)
            else:
                out[name] = v.detach().clone() if mine else None
        return out

    @torch.no_grad()
    def write_param(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set p to ``value`` (p.shape, any float dtype): the buffer view (rounded to its
        dtype) and the owned parts of the master copy (exact)."""
        p.copy_(value)
        if id(p) in self.offset and self.opt.master_is_copy:
            o = self.offset[id(p)]
            for j, a, b in self._pieces(p):
                lo = self.opt.shards[j][0]
                self.opt.masters[j][a - lo:b - lo] = value.reshape(-1)[a - o:b - o]

    @torch.no_grad()
    def write_states(self, states: dict[str, States], params: dict[str, nn.Parameter]) -> None:
        """Replace the optimizer's state with ``states`` (local name -> state name -> whole
        tensor): per-element states are cut to this rank's shards (the padding zero), a
        scalar state is taken from the first parameter that has it, for every shard."""
        masters, shards = self.opt.masters, self.opt.shards
        new: list[States] = [{} for _ in masters]
        for name in sorted(states):
            p = params[name]
            if id(p) not in self.offset:
                continue
            o = self.offset[id(p)]
            for key, value in states[name].items():
                for j, (lo, hi) in enumerate(shards):
                    if value.dim() == 0:
                        new[j].setdefault(key, value.clone())
                    else:
                        new[j].setdefault(key, masters[j].new_zeros(hi - lo, dtype=value.dtype))
                for j, a, b in self._pieces(p) if value.dim() > 0 else ():
                    new[j][key][a - shards[j][0]:b - shards[j][0]] = value.reshape(-1)[a - o:b - o]
        self.opt.load_shard_states(new)


class ShardedState:
    """ZeRO-3: parameters and their optimizer states are DTensors sharded on dim 0 over DP."""

    def __init__(self, opt: FullyShardedOptimizer) -> None:
        self.opt = opt

    @staticmethod
    def _piece(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
        """This DP rank's dim-0 piece of ``whole`` in ``like``'s layout (``torch.chunk``
        pieces, as FSDP2 and DTensor's Shard(0) cut them)."""
        local = like.to_local()
        d, r = like.device_mesh.size(), like.device_mesh.get_local_rank()
        rows = -(-whole.shape[0] // d) if whole.dim() else 0
        start = min(r * rows, whole.shape[0])
        piece = whole.narrow(0, start, local.shape[0])
        if piece.shape != local.shape:
            raise RuntimeError(f"the dim-0 piece {tuple(piece.shape)} of a {tuple(whole.shape)} "
                               f"tensor does not match the FSDP2 shard {tuple(local.shape)}")
        return piece

    def _mine(self, owner: int) -> bool:
        return self.opt.mesh.get_local_rank() == owner

    def param(self, p: DTensor, owner: int) -> torch.Tensor | None:
        """p (the fp32 master weights) whole on DP rank ``owner``: an all-gather over the
        DP mesh (DTensor has no gather to one rank), kept by the owner only."""
        whole = full_tensor(p.detach())
        return whole if self._mine(owner) else None

    def states(self, p: DTensor, owner: int) -> dict[str, torch.Tensor | None]:
        """p's optimizer states whole on DP rank ``owner`` (an all-gather per per-element
        state)."""
        state = _check_tensors(self.opt.optimizer.state.get(p, {}), "a ZeRO-3 parameter")
        out = {}
        for name, v in sorted(state.items()):
            whole = full_tensor(v) if v.dim() > 0 else v.detach().clone()
            out[name] = whole if self._mine(owner) else None
        return out

    @torch.no_grad()
    def write_param(self, p: DTensor, value: torch.Tensor) -> None:
        """Set p's local shard to its piece of ``value`` (p.shape)."""
        if isinstance(p, DTensor):
            p.to_local().copy_(self._piece(value, p))
        else:
            p.copy_(value)

    @torch.no_grad()
    def write_states(self, states: dict[str, States], params: dict[str, nn.Parameter]) -> None:
        """Replace each parameter's optimizer state with its pieces of ``states``."""
        for name, p in params.items():
            self.opt.optimizer.state.pop(p, None)
            new: States = {}
            for key, value in states.get(name, {}).items():
                if value.dim() == 0 or not isinstance(p, DTensor):
                    new[key] = value.clone()
                else:
                    new[key] = DTensor.from_local(self._piece(value, p).clone(), p.device_mesh,
                                                  p.placements, run_check=False,
                                                  shape=p.shape, stride=p.stride())
            if new:
                self.opt.optimizer.state[p] = new


def dp_state(dp_optimizer) -> FlatState | ShardedState:
    """The adapter of a ParallelModule's ``dp_optimizer``."""
    if isinstance(dp_optimizer, FullyShardedOptimizer):
        return ShardedState(dp_optimizer)
    return FlatState(dp_optimizer)
