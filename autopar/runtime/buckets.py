"""Data-parallel gradient reduction overlapped with backward, in buckets (ZeRO-0/1/2).

What torch's ``DistributedDataParallel`` (``gradient_as_bucket_view=True``) does for an
all-reduce and Megatron-LM's ``DistributedDataParallel`` (``overlap_grad_reduce`` with the
distributed optimizer) does for a reduce-scatter, over autopar's flat parameter buffer:

* :func:`cut_buckets` cuts the buffer into buckets, contiguous ranges taken from its end
  (the last layers' gradients are ready first in backward): the first of at least
  ``first_bucket_bytes``, then at least ``bucket_bytes`` each (DDP's defaults, 1 MiB and
  25 MiB: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``). Every
  cut is a multiple of ``align`` (the DP degree d under ZeRO-1/2), so each bucket splits
  into d equal shards and the bytes reduced are those of one collective over the whole
  buffer: no padding beyond the buffer's own. A cut may fall inside a parameter, which then
  belongs to two buckets.
* The ``deferred`` region at the start of the buffer (parameters whose gradients still get
  a sum over another group first: the tied embedding over the first and last stage, the
  sequence-parallel partial gradients over TP) forms buckets of its own, started only by
  :meth:`BucketReadiness.flush`, after those sums.
* :class:`BucketReadiness` counts each parameter's gradient accumulations with a
  post-accumulate-grad hook; when every parameter of a bucket has received its
  ``expected`` ones, the owner's ``launch`` starts the bucket's collective asynchronously
  while backward goes on with earlier layers.

The bytes sent are those of one collective over the whole gradient, as before; only their
timing changes, which is what the cost model assumes (DP communication hidden behind
backward, Narayanan et al. 2021 section 3.3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

__all__ = ["Bucket", "BucketReadiness", "cut_buckets", "chunk_parameters", "BUCKET_BYTES", "FIRST_BUCKET_BYTES",
           "DONE"]

BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default
FIRST_BUCKET_BYTES = 2**20  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


@dataclass
class Bucket:
    """The flat range [start, end) of a gradient buffer reduced by one collective."""

    start: int
    end: int
    params: list[nn.Parameter]  # every parameter with elements in [start, end)
    deferred: bool = False  # started by flush() only
    count: int = 0  # accumulations seen this round
    work: object = field(default=None, repr=False)  # the collective's handle once started
    in_backward: bool = False  # started by the hook (overlapped), not by flush()
    group: object = None  # the process group reducing it (None: the owner's DP group)

    def shard(self, d: int, rank: int) -> tuple[int, int]:
        """[lo, hi) of the buffer that DP rank ``rank`` of ``d`` owns in this bucket."""
        k = (self.end - self.start) // d
        return self.start + rank * k, self.start + (rank + 1) * k


class _Done:
    """The handle of a collective that had nothing to do (a group of one rank)."""

    def wait(self) -> bool:
        return True


DONE = _Done()


def cut_buckets(params: Sequence[nn.Parameter], offsets: Sequence[int], total: int, *,
                element_size: int, align: int = 1, deferred_end: int = 0,
                bucket_bytes: int = BUCKET_BYTES,
                first_bucket_bytes: int = FIRST_BUCKET_BYTES, tail: int = 0,
                tail_group: object = None) -> list[Bucket]:
    """Buckets of a flat buffer of ``total`` elements (a multiple of ``align``) holding
    ``params`` at ``offsets``, in the order backward fills them (from the buffer's end).

    Every bucket boundary is a multiple of ``align``; the elements [0, deferred_end) (the
    deferred parameters) end a bucket at ``deferred_end`` rounded up to ``align``, and
    buckets holding any of them are ``deferred``. ``tail``: the last ``tail`` elements
    (expert parameters, which must start exactly there; align 1) form buckets of their
    own, reduced over ``tail_group``.

    Raises ValueError when ``total`` is not a multiple of ``align``.
    """
    if tail:
        split = total - tail
        head = [i for i, o in enumerate(offsets) if o < split]
        rest = [i for i, o in enumerate(offsets) if o >= split]
        sizes = dict(element_size=element_size, bucket_bytes=bucket_bytes,
                     first_bucket_bytes=first_bucket_bytes)
        own = cut_buckets([params[i] for i in rest], [offsets[i] - split for i in rest], tail,
                          **sizes)
        return (cut_buckets([params[i] for i in head], [offsets[i] for i in head], split,
                            align=align, deferred_end=deferred_end, **sizes)
                + [Bucket(b.start + split, b.end + split, b.params, group=tail_group)
                   for b in own])
    if total % align:
        raise ValueError(f"a buffer of {total} elements does not split into {align} equal shards")
    def up(x: int) -> int:
        return -(-x // align) * align

    cuts, end, cap = [total], total, first_bucket_bytes
    deferred_cut = up(deferred_end)
    for start in sorted(set(offsets), reverse=True):
        cut = up(start)
        if 0 < cut < end and (cut == deferred_cut or (end - cut) * element_size >= cap):
            cuts.append(cut)
            end, cap = cut, bucket_bytes
    if 0 < deferred_cut < end and deferred_cut not in cuts:
        cuts.append(deferred_cut)
    cuts = sorted(set(cuts) | {0}, reverse=True)
    buckets = []
    for hi, lo in zip(cuts, cuts[1:]):
        members = [p for p, o in zip(params, offsets) if o < hi and o + p.numel() > lo]
        buckets.append(Bucket(lo, hi, members, deferred=lo < deferred_end))
    return buckets


class BucketReadiness:
    """Starts each bucket's collective once backward has produced its gradients.

    Args:
        buckets: from :func:`cut_buckets`.
        launch: starts a bucket's collective and returns its handle (``async_op=True``).
        expected: accumulations each parameter receives per round (a step's micro-batches
            for ZeRO-0/1; 1 for ZeRO-2, whose round is one micro-batch).
        uses: parameter id -> backward passes per micro-batch that accumulate into it (the
            model chunks of this rank holding it: a V placement's first rank holds the tied
            embedding in its first and its last chunk); 1 when absent.

    Raises RuntimeError (in backward) when a parameter accumulates more often than
    ``expected`` times in a round: its bucket would have been reduced too early.
    """

    def __init__(self, buckets: list[Bucket], launch: Callable[[Bucket], object], *,
                 expected: int, uses: dict[int, int] | None = None) -> None:
        self.buckets, self.launch, self.expected = buckets, launch, expected
        uses = uses or {}
        self._expected = {id(b): expected * sum(uses.get(id(p), 1) for p in b.params)
                          for b in buckets}  # accumulations that complete each bucket
        self._buckets_of: dict[int, list[Bucket]] = {}
        for bucket in buckets:
            for p in bucket.params:
                self._buckets_of.setdefault(id(p), []).append(bucket)
        self._active = False
        self.started_in_backward = 0  # buckets of the last flushed round backward started
        hooked = {id(p): p for b in buckets for p in b.params}
        for p in hooked.values():
            p.register_post_accumulate_grad_hook(self._accumulated)

    def buckets_of(self, p: nn.Parameter) -> list[Bucket]:
        """The buckets holding elements of ``p`` (one, or two when a cut falls inside it)."""
        return self._buckets_of[id(p)]

    def start_round(self) -> None:
        """Arm the hooks for a round (a step, or a ZeRO-2 micro-batch)."""
        for bucket in self.buckets:
            bucket.count, bucket.work, bucket.in_backward = 0, None, False
        self._active = True

    def _accumulated(self, p: nn.Parameter) -> None:
        if not self._active:
            return
        for bucket in self._buckets_of[id(p)]:
            bucket.count += 1
            expected = self._expected[id(bucket)]
            if bucket.count > expected:
                raise RuntimeError(f"a parameter of shape {tuple(p.shape)} accumulated its "
                                   f"gradient more than {self.expected} times in one round; "
                                   "its bucket was reduced before its last accumulation")
            if bucket.count == expected and not bucket.deferred:
                bucket.in_backward = True
                bucket.work = self.launch(bucket)

    def flush(self) -> list[Bucket]:
        """Start the deferred buckets and those backward did not complete (parameters without
        a gradient this round), wait for every bucket's collective, disarm the hooks.
        Returns the buckets."""
        self.started_in_backward = sum(b.in_backward for b in self.buckets)
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.work = self.launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
        self._active = False
        return self.buckets


def chunk_parameters(stage_module: nn.Module) -> list[nn.Parameter]:
    """The parameters of a rank's model chunks, once per chunk holding them: the chunks of
    an ``nn.ModuleList`` (interleaved and V placements) each in turn, else the module's."""
    chunks = stage_module if isinstance(stage_module, nn.ModuleList) else [stage_module]
    return [p for chunk in chunks for p in chunk.parameters()]
