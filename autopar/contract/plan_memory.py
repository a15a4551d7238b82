"""A plan's memory against the device, in words: the peak, the reserve by kind and the
margin of :class:`~autopar.contract.plan.Prediction` (:mod:`cost_models.reserve`). Read by
``Plan.summary``, the report and the binding line; reads only the Prediction."""

from __future__ import annotations

__all__ = ["RESERVE_NAMES", "binding_stage", "reserve_parts", "memory_line"]

GIB = 2**30
RESERVE_NAMES = {"cuda_context": "CUDA context", "nccl_buffers": "NCCL buffers",
                 "loss_logits": "fp32 loss logits", "pp_p2p_buffers": "p2p buffers",
                 "dp_bucket": "DP bucket", "fragmentation": "fragmentation",
                 "headroom": "headroom"}
"""Display names of the reserve kinds (``cost_models.reserve.RESERVE_KINDS``)."""


def _size(num_bytes: float) -> str:
    """``3.72 GiB``, ``231 MiB``, ``12 KiB`` (negative sizes keep their sign)."""
    b = abs(num_bytes)
    unit, scale, digits = (("GiB", GIB, 2) if b >= GIB else ("MiB", 2**20, 0) if b >= 2**20
                           else ("KiB", 2**10, 0))
    return f"{num_bytes / scale:.{digits}f} {unit}"


def binding_stage(predicted, device_bytes: float) -> int:
    """The pipeline stage with the least margin (device - reserve - peak); the peak-memory
    stage when the prediction carries no reserve."""
    stages = predicted.memory_bytes_by_stage
    reserve = predicted.memory_reserve_bytes_by_stage or [{} for _ in stages]
    margins = [device_bytes - sum(r.values()) - sum(m.values()) for r, m in zip(reserve, stages)]
    return min(range(len(margins)), key=margins.__getitem__)


def reserve_parts(reserve: dict[str, float], shown: int = 4) -> str:
    """``fragmentation 3.72 GiB, p2p buffers 816 MiB, CUDA context 512 MiB, 2 more``
    (largest first, zero kinds left out)."""
    parts = sorted(((v, k) for k, v in reserve.items() if v > 0), reverse=True)
    text = ", ".join(f"{RESERVE_NAMES.get(k, k)} {_size(v)}" for v, k in parts[:shown])
    return text + (f", {len(parts) - shown} more" if len(parts) > shown else "")


def memory_line(predicted, device_bytes: float | None) -> str:
    """``memory per GPU (stage 0, the least margin): peak 70.10 GiB + reserve 6.30 GiB
    (fragmentation 3.72 GiB, ...) of 80 GiB: margin 3.60 GiB``; without the device size or
    a recorded reserve, the peak only."""
    if not device_bytes or not predicted.memory_reserve_bytes_by_stage:
        of = f" of {device_bytes / GIB:.0f} GiB (no reserve recorded)" if device_bytes else ""
        return f"memory per GPU: peak {_size(predicted.peak_memory_bytes)}{of}"
    i = binding_stage(predicted, device_bytes)
    peak = sum(predicted.memory_bytes_by_stage[i].values())
    reserve = (predicted.memory_reserve_bytes_by_stage or [{}] * (i + 1))[i]
    return (f"memory per GPU (stage {i}, the least margin): peak {_size(peak)} + reserve "
            f"{_size(sum(reserve.values()))} ({reserve_parts(reserve) or 'none'}) of "
            f"{device_bytes / GIB:.0f} GiB: margin {_size(predicted.memory_margin_bytes)}")
