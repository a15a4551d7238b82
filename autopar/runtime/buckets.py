"""Data-parallel gradient all-reduce overlapped with backward, in buckets (ZeRO-0).

What torch's ``DistributedDataParallel`` (``gradient_as_bucket_view=True``) and Megatron-LM's
``DistributedDataParallel`` (``overlap_grad_reduce``) do, over autopar's flat gradient:

* The parameters' ``.grad`` are views of one persistent flat gradient buffer, so autograd
  accumulates every micro-batch's gradient into it in place.
* The buffer is cut into buckets, contiguous ranges of whole parameters taken from its
  end (the last layers' gradients are ready first in backward): the first bucket of
  about ``first_bucket_bytes``, then about ``bucket_bytes`` each (DDP's defaults, 1 MiB and
  25 MiB: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``).
* A post-accumulate-grad hook counts each parameter's accumulations; when every parameter
  of a bucket has received its last one of the step (``accumulations`` per step: one per
  micro-batch), the bucket's all-reduce starts asynchronously while backward goes on
  with earlier layers. :meth:`OverlappedAllReduce.finish` waits for them all.

The bytes sent are those of one all-reduce of the whole gradient, as before; only their
timing changes, which is what the cost model assumes (DP communication hidden behind
backward, Narayanan et al. 2021 section 3.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["OverlappedAllReduce", "BUCKET_BYTES", "FIRST_BUCKET_BYTES"]

BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default
FIRST_BUCKET_BYTES = 2**20  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


@dataclass
class _Bucket:
    start: int  # [start, end) of the flat gradient
    end: int
    params: list[nn.Parameter]
    count: int = 0
    work: object = field(default=None, repr=False)


class OverlappedAllReduce:
    """Bucketed asynchronous all-reduce (sum) of a flat gradient over ``group``.

    Args:
        params: the parameters, in the order of their ranges in ``grads``.
        grads: the flat gradient buffer (numel,), of which the caller makes every
            parameter's ``.grad`` a view before backward.
        group: the data-parallel process group.
        accumulations: backward passes per step that reach every parameter (micro-batches).
        bucket_bytes / first_bucket_bytes: bucket sizes (bytes of gradient).

    Raises RuntimeError (in backward) when a parameter accumulates more often than
    ``accumulations`` times in a step: its bucket would have been reduced too early.
    """

    def __init__(self, params: list[nn.Parameter], grads: torch.Tensor, group, *,
                 accumulations: int, bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> None:
        self.params, self.grads, self.group = params, grads, group
        self.accumulations = accumulations
        offsets, offset = [], 0
        for p in params:
            offsets.append(offset)
            offset += p.numel()
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        end, members, cap = offset, [], first_bucket_bytes
        for p, start in reversed(list(zip(params, offsets))):
            members.append(p)
            if (end - start) * grads.element_size() >= cap or start == 0:
                bucket = _Bucket(start, end, members)
                self.buckets.append(bucket)
                self._bucket_of.update((id(q), bucket) for q in members)
                end, members, cap = start, [], bucket_bytes
        self._active = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def start_step(self) -> None:
        """Arm the hooks for a step (the ``.grad`` views of ``grads`` already zeroed)."""
        for bucket in self.buckets:
            bucket.count, bucket.work = 0, None
        self._active = True

    def _accumulated(self, p: nn.Parameter) -> None:
        if not self._active:
            return
        bucket = self._bucket_of[id(p)]
        bucket.count += 1
        expected = self.accumulations * len(bucket.params)
        if bucket.count > expected:
            raise RuntimeError(f"a parameter of shape {tuple(p.shape)} accumulated its gradient "
                               f"more than {self.accumulations} times in one step; its bucket "
                               "was all-reduced before its last accumulation")
        if bucket.count == expected:
            bucket.work = self._launch(bucket)

    def _launch(self, bucket: _Bucket):
        return dist.all_reduce(self.grads[bucket.start:bucket.end], op=dist.ReduceOp.SUM,
                               group=self.group, async_op=True)

    def finish(self) -> None:
        """Start the buckets backward did not complete (parameters without a gradient this
        step), then wait for every bucket's all-reduce."""
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.work = self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
        self._active = False
