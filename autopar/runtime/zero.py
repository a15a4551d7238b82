"""The optimizer side of a step: data-parallel gradient sync, ZeRO-1/2 sharding, bf16 master weights.

:class:`DistributedOptimizer` follows Megatron-LM's distributed optimizer (Shoeybi et al.,
``megatron/core/optimizer/distrib_optimizer.py`` and ``distributed/param_and_grad_buffer.py``),
which is ZeRO (Rajbhandari et al. 2020, section 5) over one contiguous buffer per pipeline
stage:

* The stage's parameters become views of one flat buffer of ``numel`` elements, padded to
  a multiple of d (the DP degree) from ZeRO-1 on. The parameters whose gradients still
  need a sum over another group before the DP reduction (``deferred``: the tied embedding,
  sequence-parallel partial gradients) come first, then the others in module order.
* The buffer is cut into buckets (:mod:`autopar.runtime.buckets`), each a multiple of d
  elements; DP rank r owns the r-th of d equal shards of every bucket (Megatron's
  per-bucket sharding), so a bucket's reduction can start as soon as backward has produced
  its gradients, while backward goes on.
* ZeRO-0: the parameters' ``.grad`` view one persistent flat gradient, which each bucket
  all-reduces (as torch's DDP with ``gradient_as_bucket_view``); every rank updates all.
* ZeRO-1: the same persistent flat gradient; each bucket is reduce-scattered in place
  (rank r receives the sum of its shard), the optimizer updates only the owned shards, and
  each bucket's updated shards are all-gathered back into the buffer: the bytes of one
  all-reduce (ring reduce-scatter + all-gather), optimizer states 1/d.
* ZeRO-2: as ZeRO-1, but each bucket is reduce-scattered after every micro-batch's
  backward from a temporary copy, the parameters' gradients are freed and only the owned
  shards are accumulated, so kept gradients are 1/d too (as DeepSpeed's stage 2 does; it
  costs a reduce-scatter per micro-batch, and like DeepSpeed it is not combined with
  pipeline parallelism: the pipeline schedule owns the micro-batch loop). ZeRO-3 (sharded
  parameters) runs through FSDP2 instead: :class:`autopar.runtime.fsdp.FullyShardedOptimizer`,
  same interface.
* Mixed precision (``master_dtype`` float32 with bf16 parameters): the model computes,
  stores and communicates parameters and gradients in bf16; the optimizer keeps fp32
  master weights (and its states) for the shards it owns and rounds them into the bf16
  buffer after each step: 2 + 2 + 12 bytes per parameter before sharding, the ZeRO
  paper's K = 12 (section 3.1). With fp32 parameters the master shards are views of the
  buffer itself (no copy): 4 + 4 + 8.

The optimizer runs on one flat tensor per owned shard, so it must be element-wise (SGD,
Adam, AdamW, ...), as Megatron's; per-tensor ones (LAMB, Adafactor) would see flat pieces.

Expert parallelism (ZeRO-0): the ``experts`` (this rank's E/ep experts) end the buffer in
buckets of their own, summed over the expert-data-parallel group (the t·d/ep ranks of the
stage with the same experts: all d replicas, each TP rank's token share when EP spans TP),
divided by d; the all-to-all's backward brings the EP group's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.buckets import (BUCKET_BYTES, DONE, FIRST_BUCKET_BYTES, Bucket,
                                     BucketReadiness, cut_buckets)
from autopar.runtime.compat import all_gather_single, reduce_scatter_single, storage_key
from autopar.runtime.health import square_sum
from autopar.contract.support import EXECUTED_ZERO_STAGES

__all__ = ["DistributedOptimizer", "EXECUTED_ZERO_STAGES", "OPTIMIZER_PIECE_NUMEL"]

# The optimizer steps each owned shard as pieces of at most this many elements (2 MiB of
# fp32). Element-wise optimizers give bitwise the same update on pieces as on one flat
# tensor, but torch's per-tensor (non-foreach) path, its default on CPU, allocates several
# temporaries of the tensor's size per step: at 3.2M elements a flat AdamW step took 35 ms
# against 18 ms in pieces of 2**19 (one core, measured with torch 2.13 on this project's
# 2-core CPU machine), since large temporaries are fresh pages on every step.
OPTIMIZER_PIECE_NUMEL = 2**19


class DistributedOptimizer:
    """Gradient sync + optimizer step for one stage's parameters over the DP group.

    Args:
        params: the stage's parameters, once per chunk holding them (a V placement's
            tied embedding twice: :func:`~autopar.runtime.buckets.chunk_parameters`).
        optimizer_factory: builds an element-wise torch optimizer from a list of tensors.
        dp_group: the data-parallel process group (d ranks).
        zero_stage: 0, 1 or 2 (see the module docstring).
        master_dtype: dtype of the weights the optimizer updates; float32 with bf16
            parameters is mixed precision, or the parameters' own dtype.
        accumulations: backward passes per step (micro-batches): after the last one a
            ZeRO-0/1 bucket's reduction starts.
        deferred: parameters whose gradient the caller sums over another group before the
            DP reduction (ZeRO-1/2 only; under ZeRO-0 every rank holds the whole reduced
            gradient and the sums follow it): their buckets start in
            :meth:`reduce_gradients` (ZeRO-2: :meth:`micro_batch_done`).
        bucket_bytes, first_bucket_bytes: bucket sizes, bytes of gradient.
        piece_numel: the most elements of one tensor the optimizer steps (see
            :data:`OPTIMIZER_PIECE_NUMEL`).
        experts, expert_group: expert parameters, their EDP group (module docstring).

    Attributes:
        params: the parameters in buffer order; ``offsets[i]`` is ``params[i]``'s start.
        shards: the [lo, hi) ranges of the buffer this rank's optimizer owns (ZeRO-0: the
            whole buffer), one per bucket from ZeRO-1 on; ``masters[j]`` holds the
            weights for ``shards[j]``; ``master_is_copy``: True when they are a separate
            (fp32) copy, False when they view the buffer. ``pieces[j]``: the parameters the
            optimizer steps, consecutive pieces of ``masters[j]`` (aliasing it).
        buckets: the buffer's buckets (:func:`~autopar.runtime.buckets.cut_buckets`).

    Raises:
        ValueError: zero_stage not in (0, 1, 2), parameters of mixed dtypes or devices,
            expert parameters with zero_stage > 0.
    """

    def __init__(self, params: Iterable[nn.Parameter],
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 dp_group, zero_stage: int = 0, master_dtype: torch.dtype | None = None,
                 accumulations: int = 1, deferred: Iterable[nn.Parameter] = (),
                 bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 piece_numel: int = OPTIMIZER_PIECE_NUMEL,
                 experts: Iterable[nn.Parameter] = (), expert_group=None) -> None:
        if zero_stage not in EXECUTED_ZERO_STAGES:
            raise ValueError(f"zero_stage={zero_stage!r} is not executed (supported: "
                             f"{EXECUTED_ZERO_STAGES}); ZeRO-3 shards parameters: use "
                             "autopar.runtime.fsdp.FullyShardedOptimizer")
        params = [p for p in params if p.requires_grad]
        uses = Counter(id(p) for p in params)  # a parameter in several of the rank's chunks
        params = list({id(p): p for p in params}.values())
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"a stage's parameters must share one dtype and device, got {kinds}; "
                             "cast the model (model.to(dtype)) before parallelizing")
        dtype, device = kinds.pop() if kinds else (torch.float32, torch.device("cpu"))
        self.group, self.zero_stage = dp_group, zero_stage
        self.d, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.sharded = zero_stage >= 1 and self.d > 1
        late = {id(p) for p in deferred} if self.sharded else set()
        expert = {id(p) for p in experts}
        if expert and zero_stage:
            raise ValueError(f"expert-parallel parameters with zero_stage={zero_stage}: ZeRO over"
                             " the expert-data-parallel group is not built; use zero_stage=0")
        self.params = ([p for p in params if id(p) in late] + [p for p in params if id(p)
                       not in late | expert] + [p for p in params if id(p) in expert])
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        align = self.d if self.sharded else 1
        self.padded_numel = -(-self.numel // align) * align
        self.buffer = torch.zeros(self.padded_numel, dtype=dtype, device=device)  # (padded,)
        for p, o in zip(self.params, self.offsets):  # the parameters become views of it
            view = self.buffer[o:o + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        deferred_end = sum(p.numel() for p in self.params if id(p) in late)
        self.buckets = cut_buckets(self.params, self.offsets, self.padded_numel,
                                   element_size=self.buffer.element_size(), align=align,
                                   deferred_end=deferred_end, bucket_bytes=bucket_bytes,
                                   first_bucket_bytes=first_bucket_bytes,
                                   tail=sum(p.numel() for p in self.params if id(p) in expert),
                                   tail_group=expert_group)
        lead = (self.dp_rank == 0 or self.sharded,  # who counts the norm: ZeRO-0 DP rank 0,
                not expert or dist.get_rank(expert_group) == 0)  # experts EDP rank 0
        self._norm_owned = {id(p) for p in self.params if lead[id(p) in expert]}
        self.shards = ([b.shard(self.d, self.dp_rank) for b in self.buckets] if self.sharded
                       else [(0, self.padded_numel)])
        master_dtype = master_dtype or dtype
        self.master_is_copy = master_dtype != dtype  # else the masters view the buffer
        self.masters = [self.buffer[lo:hi] if master_dtype == dtype
                        else self.buffer[lo:hi].to(master_dtype) for lo, hi in self.shards]
        # the tensors the optimizer steps: pieces of the masters (aliasing them), each
        # (hi - lo,) with hi - lo <= piece_numel, shard j's pieces in order
        self.pieces = [[nn.Parameter(m[a:a + piece_numel]) for a in range(0, m.numel(), piece_numel)]
                       for m in self.masters]
        self.optimizer = optimizer_factory([p for ps in self.pieces for p in ps])
        # the gradient: ZeRO-0/1 a persistent flat buffer the parameters' .grad view;
        # ZeRO-2 only the owned shards (_shard_grads), filled after each micro-batch
        self._grads = torch.zeros_like(self.buffer) if zero_stage < 2 or not self.sharded else None
        self._shard_grads = (self.buffer.new_zeros(self.padded_numel // self.d)
                             if self._grads is None else None)
        self._pending: dict[int, torch.Tensor] = {}  # ZeRO-2: bucket start -> its reduced shard
        self._owned: list[torch.Tensor] = []  # the reduced gradient of each shard
        self._readiness = None
        if self.d > 1:
            launch = self._launch_micro_batch if self._grads is None else self._launch
            self._readiness = BucketReadiness(self.buckets, launch, uses=uses,
                                              expected=1 if self._grads is None else accumulations)
        self._norm_ranges: tuple[object, list[tuple[int, int, int]]] | None = None

    def _owned_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each owned shard's part of ``flat``: the whole (padded,) buffer, or the
        concatenated owned shards (padded/d,) under ZeRO-2."""
        if flat.numel() == self.padded_numel:
            return [flat[lo:hi] for lo, hi in self.shards]
        views, at = [], 0
        for lo, hi in self.shards:
            views.append(flat[at:at + hi - lo])
            at += hi - lo
        return views

    def zero_grad(self) -> None:
        """Drop the previous step's gradients and arm the bucket hooks. ZeRO-0/1: zero the
        persistent flat gradient, which the parameters' ``.grad`` view from now on."""
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None
        self._owned, self._pending = [], {}
        if self._grads is not None:
            self._grads.zero_()
            self._bind_grads(self._grads)
        else:
            self._shard_grads.zero_()
        if self._readiness is not None:
            self._readiness.start_round()

    def _bind_grads(self, flat: torch.Tensor) -> None:
        """Make every parameter's ``.grad`` a view of ``flat`` (padded_numel,)."""
        for p, o in zip(self.params, self.offsets):
            p.grad = flat[o:o + p.numel()].view_as(p)

    def _launch(self, bucket: Bucket):
        """ZeRO-0: all-reduce the bucket; ZeRO-1: reduce-scatter it in place (this rank's
        shard of the persistent gradient receives the sum)."""
        whole = self._grads[bucket.start:bucket.end]
        if not self.sharded:
            group = self.group if bucket.group is None else bucket.group
            if dist.get_world_size(group) == 1:  # experts of ep = d: no EDP replica
                return DONE
            return dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=group, async_op=True)
        lo, hi = bucket.shard(self.d, self.dp_rank)
        return reduce_scatter_single(self._grads[lo:hi], whole, op=dist.ReduceOp.SUM,
                                     group=self.group, async_op=True)

    def _launch_micro_batch(self, bucket: Bucket):
        """ZeRO-2: copy the bucket's gradients into a temporary flat tensor, free the
        parameters' gradients no other pending bucket needs, reduce-scatter the copy."""
        flat = self.buffer.new_zeros(bucket.end - bucket.start)
        for p, o in zip(self.params, self.offsets):
            a, b = max(o, bucket.start), min(o + p.numel(), bucket.end)
            if a < b and p.grad is not None:
                flat[a - bucket.start:b - bucket.start] = p.grad.reshape(-1)[a - o:b - o]
        for p in bucket.params:
            if all(b.work is not None or b is bucket for b in self._readiness.buckets_of(p)):
                p.grad = None
        k = flat.numel() // self.d
        out = flat[self.dp_rank * k:(self.dp_rank + 1) * k]
        self._pending[bucket.start] = out
        return reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)

    def micro_batch_done(self) -> None:
        """After a micro-batch's backward: ZeRO-2 starts its remaining buckets, waits for
        every bucket's reduce-scatter, adds the reduced shards to the kept ones and frees
        the rest (the caller summed the deferred gradients before); others do nothing."""
        if self._grads is not None:
            return
        if self._readiness is None:  # d == 1 is ZeRO-0's path: never here
            return
        for bucket, own in zip(self._readiness.flush(), self._owned_views(self._shard_grads)):
            own.add_(self._pending.pop(bucket.start))
        for p in self.params:
            p.grad = None
        self._readiness.start_round()

    def reduce_gradients(self) -> None:
        """Synchronise the step's gradients over DP: afterwards each owned shard's part of
        the averaged gradient is in ``_owned`` (ZeRO-0: the whole flat gradient, which
        every parameter's ``.grad`` views; ZeRO-1: the owned shards of the flat gradient
        the parameters view; ZeRO-2: the accumulated shards). The caller has summed the
        deferred parameters' gradients (ZeRO-1/2)."""
        if self._grads is None:  # ZeRO-2: reduced after every micro-batch
            self._owned = self._owned_views(self._shard_grads.div_(self.d))
            return
        if self._readiness is not None:
            self._readiness.flush()
        self._owned = self._owned_views(self._grads)
        if self.d > 1:
            for own in self._owned:
                own.div_(self.d)

    def overlapped_buckets(self) -> tuple[int, int]:
        """(buckets whose reduction the last backward started, buckets): the overlap achieved
        in the last step (ZeRO-2: its last micro-batch)."""
        if self._readiness is None:
            return 0, len(self.buckets)
        return self._readiness.started_in_backward, len(self.buckets)

    def synchronize_gradients(self) -> None:
        """After ``step``: make every parameter's ``.grad`` the step's DP-averaged gradient,
        for inspection (``autopar verify``). ZeRO-1/2 keep only their own shards averaged, so
        this all-gathers each bucket's shards over DP (collectives over the DP group; not
        counted in the step's communication). ZeRO-0: nothing to do."""
        if not self.sharded:
            return
        flat = self._grads if self._grads is not None else self.buffer.new_zeros(self.padded_numel)
        for bucket, own in zip(self.buckets, self._owned):
            lo, hi = bucket.shard(self.d, self.dp_rank)
            if flat[lo:hi].data_ptr() != own.data_ptr():
                flat[lo:hi] = own
            all_gather_single(flat[bucket.start:bucket.end], flat[lo:hi], group=self.group)
        self._bind_grads(flat)

    def _counted_ranges(self, counted: set[int]) -> list[tuple[int, int, int]]:
        """(shard j, start, end) ranges, relative to shard j, of the owned gradient holding
        the parameters in ``counted`` (ids); computed once per ``counted`` object."""
        if self._norm_ranges is None or self._norm_ranges[0] is not counted:
            ranges = []
            for j, (lo, hi) in enumerate(self.shards):
                for p, o in zip(self.params, self.offsets):
                    a, b = max(o, lo), min(o + p.numel(), hi)
                    if id(p) not in counted or id(p) not in self._norm_owned or a >= b:
                        continue
                    if ranges and ranges[-1][0] == j and ranges[-1][2] == a - lo:
                        ranges[-1] = (j, ranges[-1][1], b - lo)  # adjacent: one range
                    else:
                        ranges.append((j, a - lo, b - lo))
            self._norm_ranges = (counted, ranges)
        return self._norm_ranges[1]

    def grad_square_sum(self, counted: set[int]) -> torch.Tensor:
        """Sum of squares (a float64 scalar tensor on the gradient's device) of the reduced
        gradient elements this rank owns among the parameters in ``counted`` (ids): its
        ZeRO shards, or under ZeRO-0 (every DP rank holds the whole gradient) the whole
        gradient on DP rank 0 and nothing on the others, so that the sum over the DP group
        counts each element once (expert parameters: on EDP rank 0, each EP rank's own
        experts). Call after :meth:`reduce_gradients`."""
        total = self.buffer.new_zeros((), dtype=torch.float64)
        for j, a, b in self._counted_ranges(counted):
            total += square_sum(self._owned[j][a:b])
        return total

    def scale_gradients(self, factor: float) -> None:
        """Multiply the reduced gradient by ``factor`` (gradient clipping); 1 does nothing."""
        if factor != 1.0:
            for own in self._owned:
                own.mul_(factor)

    def step(self) -> None:
        """Step the optimizer on the owned shards of the reduced gradient and put the updated
        weights back into every rank's parameters (ZeRO-1/2: an all-gather per bucket).
        Call after :meth:`reduce_gradients`."""
        for m, pieces, own in zip(self.masters, self.pieces, self._owned):
            grad = own.to(m.dtype)  # (hi - lo,), no copy when the dtypes agree
            at = 0
            for piece in pieces:
                piece.grad = grad[at:at + piece.numel()]
                at += piece.numel()
        self.optimizer.step()
        for m, pieces, (lo, hi) in zip(self.masters, self.pieces, self.shards):
            for piece in pieces:
                piece.grad = None  # the kept gradient is the parameters' (or the ZeRO-2 shards)
            if self.master_is_copy:
                self.buffer[lo:hi].copy_(m)
        if self.sharded:
            for bucket, (lo, hi) in zip(self.buckets, self.shards):
                all_gather_single(self.buffer[bucket.start:bucket.end], self.buffer[lo:hi],
                                  group=self.group)

    def state_bytes(self) -> int:
        """Bytes held for the model between steps on this rank: parameters (the buffer),
        gradients (the parameters' or the ZeRO-2 shards), fp32 master copy, optimizer states."""
        total = self.buffer.numel() * self.buffer.element_size()
        storages = {}
        for p in self.params:  # views of one flat gradient count once
            if p.grad is not None:
                storages[storage_key(p.grad)] = p.grad.untyped_storage().nbytes()
        total += sum(storages.values())
        if self._shard_grads is not None:
            total += self._shard_grads.numel() * self._shard_grads.element_size()
        for m in self.masters:
            if self.master_is_copy:
                total += m.numel() * m.element_size()
        for piece in (p for ps in self.pieces for p in ps):
            for v in self.optimizer.state.get(piece, {}).values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total

    def shard_states(self) -> list[dict[str, object]]:
        """The optimizer's state of each owned shard j: per-element tensors (hi_j - lo_j,),
        its pieces' states concatenated; other values (AdamW's scalar ``step``, SGD's
        ``momentum_buffer=None``) the first piece's. ``{}`` before the first step."""
        out = []
        for pieces in self.pieces:
            states = [self.optimizer.state.get(p, {}) for p in pieces]
            if not states or not states[0]:
                out.append({})
                continue
            out.append({key: torch.cat([s[key] for s in states])
                        if torch.is_tensor(v) and v.dim() > 0 else v
                        for key, v in states[0].items()})
        return out

    @torch.no_grad()
    def load_shard_states(self, states: list[dict[str, torch.Tensor]]) -> None:
        """Replace the optimizer's state with ``states[j]`` for shard j (as
        :meth:`shard_states` returns it), cut into the shard's pieces."""
        for pieces, state in zip(self.pieces, states):
            at = 0
            for piece in pieces:
                self.optimizer.state.pop(piece, None)
                if state:
                    self.optimizer.state[piece] = {
                        key: v[at:at + piece.numel()].clone() if v.dim() > 0 else v.clone()
                        for key, v in state.items()}
                at += piece.numel()
