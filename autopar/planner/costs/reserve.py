"""The memory reserve of one pipeline rank of a Config: what its process holds besides the
model states and activations the cost model predicts (:mod:`cost_models.reserve`).

Every reader of device memory goes through here, so the CP-SAT rows
(:meth:`~autopar.planner.cpsat.ConfigModel.add_memory`), the pruning bounds
(:mod:`autopar.planner.search.bounds`), the exhaustive oracle and ``predict`` agree: rank i fits when

    peak_i + loss_i <= usable_bytes(rank i),
    usable = (device - CUDA context - NCCL buffers - headroom) / (1 + fragmentation)
             - p2p receive buffers_i - one DP bucket,

where ``loss_i`` (the loss's fp32 logits, last rank only) depends on the loss's TP strategy
and so is a term of the row (:attr:`~autopar.planner.costs.tables.StrategyCost.temp_bytes`).
"""

from __future__ import annotations

from cost_models.reserve import RESERVE_KINDS, nccl_peers, p2p_buffer_bytes

from autopar.planner.costs.tables import DP_BUCKET_BYTES, Config
from autopar.planner.costs.step import in_flight_times_v

__all__ = ["p2p_bytes", "rank_temporaries", "usable_bytes", "max_usable_bytes", "rank_reserve",
           "reserve_text", "RESERVE_KINDS"]


def p2p_bytes(traced, cfg: Config) -> float:
    """Bytes of one activation sent between stages, b·s·h: ``CostTables.p2p_bytes`` without
    the tables."""
    return cfg.activation_bytes * traced.boundary_numel() * cfg.micro_batch_size


def rank_temporaries(p2p: float, cfg: Config, rank: int, on: bool = True) -> dict[str, float]:
    """Bytes of pipeline rank ``rank``'s step temporaries that do not depend on the TP
    strategies, for ``p2p`` bytes per stage-to-stage activation (:func:`p2p_bytes`):
    ``pp_p2p_buffers`` (pp > 1: one b·s·h receive buffer per chunk forward in
    flight plus one gradient, :func:`cost_models.reserve.p2p_buffer_bytes`) and ``dp_bucket``
    (d > 1: one 25 MiB gradient bucket in flight, the runtime's bucket size,
    ``autopar/runtime/buckets.py``); zeros when ``on`` is False
    (``MemoryReserve.step_temporaries``)."""
    buffers = p2p_buffer_bytes(p2p, in_flight_times_v(cfg, rank)) if cfg.pp > 1 and on else 0.0
    return {"pp_p2p_buffers": buffers,
            "dp_bucket": float(DP_BUCKET_BYTES) if cfg.dp > 1 and on else 0.0}


def usable_bytes(p2p: float, cluster, cfg: Config, rank: int) -> float:
    """Bytes that rank ``rank``'s model states, activations and loss temporaries may total
    on ``cluster`` (module docstring; ``p2p``: :func:`p2p_bytes`); negative when the reserve
    alone exceeds the device."""
    reserve = cluster.memory_reserve
    limit = reserve.allocator_limit_bytes(cluster.device.memory_bytes,
                                          nccl_peers(cfg.tp, cfg.pp, cfg.dp),
                                          cluster.memory_headroom_gib)
    return limit - sum(rank_temporaries(p2p, cfg, rank, reserve.step_temporaries).values())


def max_usable_bytes(p2p: float, cluster, cfg: Config) -> float:
    """The largest :func:`usable_bytes` over the pipeline ranks (a bound valid for any rank)."""
    return max(usable_bytes(p2p, cluster, cfg, i) for i in range(cfg.pp))


def rank_reserve(p2p: float, cluster, cfg: Config, rank: int, peak_bytes: float,
                 loss_bytes: float) -> dict[str, float]:
    """Rank ``rank``'s reserve in bytes by kind (:data:`RESERVE_KINDS`) for a predicted peak
    of ``peak_bytes`` (model states + activations) and ``loss_bytes`` of loss temporaries
    (``p2p``: :func:`p2p_bytes`)."""
    temps = {**rank_temporaries(p2p, cfg, rank, cluster.memory_reserve.step_temporaries),
             "loss_logits": loss_bytes}
    return cluster.memory_reserve.by_kind(peak_bytes, temps, nccl_peers(cfg.tp, cfg.pp, cfg.dp),
                                          cluster.memory_headroom_gib)


def reserve_text(cluster) -> str:
    """The reserve's settings in words, for error messages: ``CUDA context 0.5 GiB, NCCL
    buffers 4 MiB x 16 channels per peer, 5% fragmentation, headroom 0 GiB, plus the step's
    temporaries``."""
    r = cluster.memory_reserve
    return (f"CUDA context {r.cuda_context_gib:g} GiB, NCCL buffers "
            f"{r.nccl_buffsize_bytes / 2**20:g} MiB x {r.nccl_channels} channels per peer, "
            f"{r.fragmentation:.0%} fragmentation, headroom {cluster.memory_headroom_gib:g} GiB "
            "(--memory-headroom), plus the step's temporaries (fp32 logits, pipeline receive "
            "buffers, a DP bucket)")
