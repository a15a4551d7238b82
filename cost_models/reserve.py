"""The memory a training process holds besides its model states and saved activations.

A plan whose predicted peak (model states + activations, :mod:`cost_models.memory`) equals
device memory runs out of memory on a real GPU: the process also holds

* the **CUDA context** and the runtime's kernel images, outside PyTorch's allocator;
* **NCCL's buffers**: ``NCCL_BUFFSIZE`` (4 MiB by default) per channel and per peer
  connection of each communicator a rank joins (TP, DP, PP);
* the step's **temporaries**, allocated and freed inside the step: the fp32 logits and
  their gradient in the loss (:func:`loss_temporary_bytes`), the pipeline's receive
  buffers (:func:`p2p_buffer_bytes`) and one data-parallel gradient bucket;
* **allocator fragmentation**: the caching allocator keeps freed blocks reserved, so what
  it holds exceeds what is allocated, taken as a fraction of everything it allocates
  (the peak plus the temporaries);
* a **headroom** the user asks for (``Cluster.memory_headroom_gib``).

So a plan fits when (:meth:`MemoryReserve.allocator_limit_bytes`)

    (1 + fragmentation) · (peak + temporaries) + context + NCCL + headroom <= device memory.

Units: bytes unless a name says ``_gib`` (2**30 bytes). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_non_negative, is_number

__all__ = ["MemoryReserve", "RESERVE_KINDS", "NCCL_BUFFSIZE_BYTES", "LOSS_FP32_LIVE_COPIES",
           "nccl_peers", "loss_temporary_bytes", "p2p_buffer_bytes"]

GIB = 2**30
FP32_BYTES = 4
NCCL_BUFFSIZE_BYTES = 4 * 2**20
"""NCCL's default ``NCCL_BUFFSIZE``, 4194304 bytes (NCCL user guide, "Environment
Variables": the buffer used between each pair of GPUs, per channel)."""
LOSS_FP32_LIVE_COPIES = 2
"""fp32 copies of the (b, s, V/t) logits alive at once in the loss, besides the softmax it
keeps for backward (already a saved activation of the last stage). autopar's
vocab-parallel cross-entropy (:mod:`autopar.runtime.vocab_parallel`): forward
``x = logits.float()`` and ``x - row_max`` coexist while the second is computed; backward
``g = softmax.clone()`` and ``g * grad`` coexist before the cast back. ``F.cross_entropy``
on ``logits.float()`` (the replicated loss) is the same: the fp32 cast in forward, the
gradient of ``nll_loss`` and of ``log_softmax`` in backward."""
RESERVE_KINDS = ("cuda_context", "nccl_buffers", "loss_logits", "pp_p2p_buffers", "dp_bucket",
                 "fragmentation", "headroom")
"""The kinds of :meth:`MemoryReserve.by_kind`, in display order."""


@dataclass(frozen=True)
class MemoryReserve:
    """What one process holds outside the cost model's peak, per device.

    Defaults (a GPU; each preset states its own block and sources):

    cuda_context_gib: 0.5 GiB, the CUDA context and the kernel images PyTorch loads, outside
        its caching allocator (CUDA C++ Programming Guide, "Lazy Loading"; about 0.3-0.5 GiB
        per process on A100/H100 as ``nvidia-smi`` reports after ``torch.cuda.init()``:
        the upper end is taken).
    fragmentation: 0.05, a fraction of what the caching allocator allocates that it holds
        reserved on top (PyTorch docs, "CUDA semantics: memory management":
        ``memory_reserved`` exceeds ``memory_allocated`` by the cached, fragmented blocks;
        ``expandable_segments`` narrows the gap).
    nccl_buffsize_bytes: 4 MiB, ``NCCL_BUFFSIZE`` (NCCL user guide, "Environment Variables").
    nccl_channels: 16 channels per communicator (assumed: NCCL chooses per topology, at most
        ``NCCL_MAX_NCHANNELS`` = 32; ``NCCL_DEBUG=INFO`` prints the count); 0 for gloo.
    source: where the numbers come from.
    step_temporaries: whether the step's temporaries (loss logits, p2p buffers, a DP
        bucket; computed from the plan) are reserved too.
    """

    cuda_context_gib: float = 0.5
    fragmentation: float = 0.05
    nccl_buffsize_bytes: int = NCCL_BUFFSIZE_BYTES
    nccl_channels: int = 16
    source: str = "autopar defaults (cost_models/reserve.py: CUDA context 0.5 GiB, 5% " \
                  "fragmentation, NCCL_BUFFSIZE 4 MiB x 16 channels per peer)"
    step_temporaries: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda_context_gib", check_non_negative(
            "MemoryReserve.cuda_context_gib", self.cuda_context_gib))
        f = self.fragmentation
        if not is_number(f) or not 0 <= f < 1:
            raise ValueError(f"MemoryReserve.fragmentation must be a number in [0, 1), got {f!r}")
        object.__setattr__(self, "fragmentation", float(f))
        for name in ("nccl_buffsize_bytes", "nccl_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MemoryReserve.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.step_temporaries, bool):
            raise ValueError("MemoryReserve.step_temporaries must be true or false, got "
                             f"{self.step_temporaries!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"MemoryReserve.source must be a non-empty str, got {self.source!r}")

    @classmethod
    def none(cls) -> "MemoryReserve":
        """No reserve at all, temporaries included: the whole device is the cost model's
        (autopar before the reserve; tests that probe the solver at a few KiB use it)."""
        return cls(0.0, 0.0, 0, 0, "no reserve (MemoryReserve.none())", False)

    def fixed_bytes(self, nccl_peer_count: int, headroom_gib: float = 0.0) -> dict[str, float]:
        """Bytes held whatever the step does: ``cuda_context``, ``nccl_buffers``
        (buffsize × channels × ``nccl_peer_count``, :func:`nccl_peers`) and ``headroom``."""
        peers = check_non_negative("nccl_peer_count", nccl_peer_count)
        return {"cuda_context": self.cuda_context_gib * GIB,
                "nccl_buffers": float(self.nccl_buffsize_bytes * self.nccl_channels * peers),
                "headroom": check_non_negative("headroom_gib", headroom_gib) * GIB}

    def allocator_limit_bytes(self, device_bytes: float, nccl_peer_count: int,
                              headroom_gib: float = 0.0) -> float:
        """The most the caching allocator may allocate (peak + temporaries) so that the
        process fits ``device_bytes``: (device - context - NCCL - headroom) / (1 + f).
        Negative when the fixed part alone exceeds the device."""
        fixed = sum(self.fixed_bytes(nccl_peer_count, headroom_gib).values())
        return (check_non_negative("device_bytes", device_bytes) - fixed) / (1 + self.fragmentation)

    def by_kind(self, allocated_bytes: float, temporaries: dict[str, float],
                nccl_peer_count: int, headroom_gib: float = 0.0) -> dict[str, float]:
        """The reserve in bytes by kind (:data:`RESERVE_KINDS`) of a process whose model
        states and activations peak at ``allocated_bytes``, with ``temporaries`` (kinds
        ``loss_logits``, ``pp_p2p_buffers``, ``dp_bucket``): the fixed part, the
        temporaries, and fragmentation = f × (allocated + temporaries)."""
        temps = {k: check_non_negative(f"temporaries[{k!r}]", v) for k, v in temporaries.items()}
        allocated = check_non_negative("allocated_bytes", allocated_bytes) + sum(temps.values())
        out = {**self.fixed_bytes(nccl_peer_count, headroom_gib), **temps,
               "fragmentation": self.fragmentation * allocated}
        return {k: out.get(k, 0.0) for k in RESERVE_KINDS}


def nccl_peers(tp: int, pp: int, dp: int) -> int:
    """Peer connections of one rank whose buffers NCCL allocates: 2 (ring: previous and
    next rank) in each of the TP and DP communicators with more than one rank, and the
    previous and next pipeline stage when pp > 1 (2: counted alike at the ends)."""
    return 2 * (tp > 1) + 2 * (dp > 1) + 2 * (pp > 1)


def loss_temporary_bytes(logits_elements: float, activation_bytes: int) -> float:
    """Bytes the loss allocates beyond its saved softmax for ``logits_elements`` logits on
    this rank (b·s·V/t vocabulary-parallel, b·s·V replicated): :data:`LOSS_FP32_LIVE_COPIES`
    fp32 copies, plus the 16-bit logits (forward) / their gradient (backward) when the
    activations are not already fp32 (``.float()`` of an fp32 tensor is the tensor itself)."""
    n = check_non_negative("logits_elements", logits_elements)
    cast = activation_bytes if activation_bytes != FP32_BYTES else 0
    return n * (LOSS_FP32_LIVE_COPIES * FP32_BYTES + cast)


def p2p_buffer_bytes(p2p_bytes: float, chunk_forwards_in_flight: float) -> float:
    """Pipeline receive buffers of one rank: one activation of ``p2p_bytes`` (b·s·h, or
    its sequence-parallel shard) per chunk forward in flight (the receive posted for each,
    as ``torch.distributed.pipelining`` allocates one buffer per micro-batch) plus one
    for the gradient being received in backward."""
    return check_non_negative("p2p_bytes", p2p_bytes) * (
        check_non_negative("chunk_forwards_in_flight", chunk_forwards_in_flight) + 1)
