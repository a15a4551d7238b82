"""The optimizer side of a step: data-parallel gradient sync, ZeRO-1/2 sharding, bf16 master weights.

:class:`DistributedOptimizer` follows Megatron-LM's distributed optimizer (Shoeybi et al.,
``megatron/core/optimizer/distrib_optimizer.py``), which is ZeRO (Rajbhandari et al. 2020,
section 5) over one contiguous buffer per pipeline stage:

* The stage's parameters become views of one flat buffer of ``numel`` elements, padded to
  a multiple of d (the DP degree) from ZeRO-1 on; DP rank r owns the r-th of d equal
  slices of it.
* ZeRO-0: the flat gradient is all-reduced and averaged; every rank updates everything.
  The parameters' gradients are views of one persistent flat gradient, all-reduced in
  buckets as backward produces them (:class:`~autopar.runtime.buckets.OverlappedAllReduce`,
  as torch's DDP does), so the reduction overlaps the rest of backward.
* ZeRO-1: the flat gradient is reduce-scattered (each rank receives the sum of its own
  slice), the optimizer updates only this rank's slice, and the updated slices are
  all-gathered back into the buffer: the bytes of one all-reduce (ring reduce-scatter +
  all-gather), optimizer states 1/d.
* ZeRO-2: as ZeRO-1, but the gradient is reduce-scattered after every micro-batch's
  backward and only this rank's slice is accumulated, so gradients are 1/d too (as
  DeepSpeed's stage 2 does; it costs a reduce-scatter per micro-batch, and like DeepSpeed
  it is not combined with pipeline parallelism: the pipeline schedule owns the
  micro-batch loop). ZeRO-3 (sharded parameters) runs through FSDP2 instead:
  :class:`autopar.runtime.fsdp.FullyShardedOptimizer`, same interface.
* Mixed precision (``master_dtype`` float32 with bf16 parameters): the model computes,
  stores and communicates parameters and gradients in bf16; the optimizer keeps fp32
  master weights (and its states) for the slice it owns and rounds them into the bf16
  buffer after each step: 2 + 2 + 12 bytes per parameter before sharding, the ZeRO
  paper's K = 12 (section 3.1). With fp32 parameters the master slice is the buffer
  itself (no copy): 4 + 4 + 8.

The optimizer runs on one flat tensor, so it must be element-wise (SGD, Adam, AdamW, ...),
as for Megatron's distributed optimizer; per-tensor methods (LAMB, Adafactor) would see
one big tensor instead of the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.buckets import OverlappedAllReduce
from autopar.support import EXECUTED_ZERO_STAGES

__all__ = ["DistributedOptimizer", "EXECUTED_ZERO_STAGES"]


class DistributedOptimizer:
    """Gradient sync + optimizer step for one stage's parameters over the DP group.

    Args:
        params: the stage's parameters (each once; tied parameters are one object).
        optimizer_factory: builds an element-wise torch optimizer from a list of tensors.
        dp_group: the data-parallel process group (d ranks).
        zero_stage: 0, 1 or 2 (see the module docstring).
        master_dtype: dtype of the weights the optimizer updates; float32 with bf16
            parameters is mixed precision, or the parameters' own dtype.
        accumulations: backward passes per step (micro-batches): after the last one a
            ZeRO-0 bucket's all-reduce starts.

    Raises:
        ValueError: zero_stage not in (0, 1, 2), parameters of mixed dtypes or devices.
    """

    def __init__(self, params: Iterable[nn.Parameter],
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 dp_group, zero_stage: int = 0, master_dtype: torch.dtype | None = None,
                 accumulations: int = 1) -> None:
        if zero_stage not in EXECUTED_ZERO_STAGES:
            raise ValueError(f"zero_stage={zero_stage!r} is not executed (supported: "
                             f"{EXECUTED_ZERO_STAGES}); ZeRO-3 shards parameters: use "
                             "autopar.runtime.fsdp.FullyShardedOptimizer")
        self.params = [p for p in params if p.requires_grad]
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"a stage's parameters must share one dtype and device, got {kinds}; "
                             "cast the model (model.to(dtype)) before parallelizing")
        dtype, device = kinds.pop() if kinds else (torch.float32, torch.device("cpu"))
        self.group, self.zero_stage = dp_group, zero_stage
        self.d, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.numel = sum(p.numel() for p in self.params)
        shards = self.d if zero_stage >= 1 else 1
        self.padded_numel = -(-self.numel // shards) * shards
        self.buffer = torch.zeros(self.padded_numel, dtype=dtype, device=device)  # (padded,)
        offset = 0
        for p in self.params:  # the parameters become views of the flat buffer
            view = self.buffer[offset:offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            offset += p.numel()
        size = self.padded_numel // shards
        self.lo, self.hi = (self.dp_rank * size, (self.dp_rank + 1) * size) if shards > 1 \
            else (0, self.padded_numel)
        master_dtype = master_dtype or dtype
        own = self.buffer[self.lo:self.hi]
        self.master = nn.Parameter(own if master_dtype == dtype else own.to(master_dtype))
        self.optimizer = optimizer_factory([self.master])
        self._grad_shard: torch.Tensor | None = None  # ZeRO-2: this rank's accumulated slice
        self._flat: torch.Tensor | None = None  # ZeRO-1: the step's flat gradient
        self._owned: torch.Tensor | None = None  # the reduced gradient of [lo, hi)
        self._grads = self._overlap = None  # ZeRO-0: the persistent flat gradient, buckets
        if zero_stage == 0:
            self._grads = torch.zeros_like(self.buffer)
            if self.d > 1:
                self._overlap = OverlappedAllReduce(self.params, self._grads, dp_group,
                                                    accumulations=accumulations)

    @property
    def master_is_copy(self) -> bool:
        """True when the master weights are a separate (fp32) copy of the owned slice."""
        return self.master.dtype != self.buffer.dtype

    def zero_grad(self) -> None:
        """Drop the previous step's gradients (parameters' and the owned slice's); ZeRO-0:
        zero the flat gradient, which the parameters' ``.grad`` view from now on."""
        for p in self.params:
            p.grad = None
        self.master.grad = None
        self._grad_shard = self._flat = self._owned = None
        if self._grads is not None:
            self._grads.zero_()
            self._bind_grads(self._grads)
        if self._overlap is not None:
            self._overlap.start_step()

    def _flat_grad(self) -> torch.Tensor:
        """The parameters' gradients in one padded flat tensor (padded_numel,); None -> 0."""
        flat = self.buffer.new_zeros(self.padded_numel)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        return flat

    def _bind_grads(self, flat: torch.Tensor) -> None:
        """Make every parameter's ``.grad`` a view of ``flat`` (padded_numel,)."""
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def synchronize_gradients(self) -> None:
        """After ``step``: make every parameter's ``.grad`` the step's DP-averaged gradient,
        for inspection (``autopar verify``). ZeRO-1/2 keep only their own slice averaged, so
        this all-gathers the slices over DP (collective over the DP group; not counted in
        the step's communication). ZeRO-0: nothing to do."""
        if self.zero_stage == 0:
            return
        if self.zero_stage == 1:
            flat = self._flat if self._flat is not None else self._flat_grad()
            own = flat[self.lo:self.hi].clone()
        else:
            flat = self.buffer.new_zeros(self.padded_numel)
            own = self._grad_shard if self._grad_shard is not None else flat[self.lo:self.hi].clone()
        dist.all_gather_single(flat, own.contiguous(), group=self.group)
        self._bind_grads(flat)

    def _reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """Average of the d ranks' flat gradients on this rank's slice: (padded/d,)."""
        out = flat.new_empty(self.hi - self.lo)
        dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group)
        return out.div_(self.d)

    def micro_batch_done(self) -> None:
        """After a micro-batch's backward: ZeRO-2 reduce-scatters now and keeps its slice
        only (the parameters' gradients are freed); other stages do nothing."""
        if self.zero_stage != 2:
            return
        part = self._reduce_scatter(self._flat_grad())
        self._grad_shard = part if self._grad_shard is None else self._grad_shard.add_(part)
        for p in self.params:
            p.grad = None

    def reduce_gradients(self) -> None:
        """Synchronise the step's gradients over DP: afterwards this rank's slice [lo, hi)
        of the averaged flat gradient is ``owned_grad`` (ZeRO-0: the whole flat gradient,
        which every parameter's ``.grad`` views; ZeRO-1: its own slice of the flat
        gradient the parameters view; ZeRO-2: the accumulated slice)."""
        if self.zero_stage == 0:  # the parameters' .grad view self._grads
            if self._overlap is not None:
                self._overlap.finish()
                self._grads.div_(self.d)
            self._owned = self._grads
        elif self.zero_stage == 1:
            flat = self._flat = self._flat_grad()
            self._bind_grads(flat)  # one flat gradient; its own slice becomes the average
            flat[self.lo:self.hi].copy_(self._reduce_scatter(flat))
            self._owned = flat[self.lo:self.hi]
        else:
            if self._grad_shard is None:
                self._grad_shard = self.buffer.new_zeros(self.hi - self.lo)
            self._owned = self._grad_shard

    def _counted_ranges(self, counted: set[int]) -> list[tuple[int, int]]:
        """[start, end) ranges, relative to lo, of the owned slice holding the gradients of
        the parameters in ``counted`` (ids)."""
        ranges, offset = [], 0
        for p in self.params:
            lo, hi = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if id(p) in counted and lo < hi:
                ranges.append((lo - self.lo, hi - self.lo))
            offset += p.numel()
        return ranges

    def grad_square_sum(self, counted: set[int]) -> torch.Tensor:
        """Sum of squares (a float64 scalar tensor on the gradient's device) of the reduced
        gradient elements this rank owns among the parameters in ``counted`` (ids): its
        ZeRO slice, or under ZeRO-0 (every DP
        rank holds the whole gradient) the whole gradient on DP rank 0 and nothing on the
        others, so that the sum over the DP group counts each element once. Call after
        :meth:`reduce_gradients`."""
        total = self.buffer.new_zeros((), dtype=torch.float64)
        if self.zero_stage == 0 and self.dp_rank != 0:
            return total
        for a, b in self._counted_ranges(counted):
            total += self._owned[a:b].double().square().sum()
        return total

    def scale_gradients(self, factor: float) -> None:
        """Multiply the reduced gradient by ``factor`` (gradient clipping); 1 does nothing."""
        if factor != 1.0:
            self._owned.mul_(factor)

    def step(self) -> None:
        """Step the optimizer on the owned slice of the reduced gradient and put the updated
        weights back into every rank's parameters (ZeRO-1/2: all-gather). Call after
        :meth:`reduce_gradients`."""
        self.master.grad = self._owned.to(self.master.dtype)
        self.optimizer.step()
        self.master.grad = None  # the kept gradient is the parameters' (or the ZeRO-2 slice)
        if self.master_is_copy:
            self.buffer[self.lo:self.hi].copy_(self.master.detach())
        if self.zero_stage >= 1:
            own = self.buffer[self.lo:self.hi].clone()
            dist.all_gather_single(self.buffer, own, group=self.group)

    def state_bytes(self) -> int:
        """Bytes held for the model between steps on this rank: parameters (the buffer),
        gradients (the parameters' or the ZeRO-2 slice), fp32 master copy, optimizer states."""
        total = self.buffer.numel() * self.buffer.element_size()
        grads = {id(p.grad): p.grad for p in self.params if p.grad is not None}
        storages = {}
        for g in grads.values():  # views of one flat gradient count once
            st = g.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        total += sum(storages.values())
        if self._grad_shard is not None:
            total += self._grad_shard.numel() * self._grad_shard.element_size()
        if self.master_is_copy:
            total += self.master.numel() * self.master.element_size()
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if torch.is_tensor(v) and v.dim() > 0)
        return total
