"""Which configs of a search need no CP-SAT solve (step 3 of the flow, before CP-SAT).

:func:`order_bound_s` is the bound the search visits configs in; :func:`pruned_entry`
decides, given the best step time found so far, whether a config can be skipped: its
memory lower bound exceeds device memory less the reserve, or a step-time lower bound of
:mod:`autopar.planner.bounds` (with the layer's least time and least kept bytes over whole
strategy choices, :mod:`autopar.planner.layer_bounds`) is no better than the best. Pieces
shared by the configs of one search live in its ``memo``.
"""

from __future__ import annotations

from dataclasses import asdict

from autopar.graph.annotate import TracedModel
from autopar.contract.plan import RECOMPUTE_MODES, ZERO_STAGES, Layout
from autopar.planner.bounds import (compute_bound_s, layer_pieces, memory_lower_bound_bytes,
                                    min_layer_compute_s, step_bound_s)
from autopar.planner.cost_tables import Config, cost_tables
from autopar.planner.layer_bounds import min_layer_kept_bytes, min_layer_time_s
from autopar.planner.reserve import max_usable_bytes, p2p_bytes
from autopar.planner.strategies import node_strategies
from autopar.contract.support import RuntimeSupport

__all__ = ["strategies_for", "zero_choices", "step_lower_bound_s", "order_bound_s",
           "memory_bounds", "pruned_entry"]


def strategies_for(traced: TracedModel, tp: int, sequence_parallel: bool, memo: dict):
    """:func:`~autopar.planner.strategies.node_strategies`, computed once per (tp,
    sequence_parallel) in ``memo`` (one search: every config of a TP size shares them)."""
    key = ("strategies", tp, sequence_parallel)
    if key not in memo:
        memo[key] = node_strategies(traced, tp, sequence_parallel)
    return memo[key]


def zero_choices(layout: Layout, support: RuntimeSupport | None, cfg: Config) -> tuple[int, ...]:
    """ZeRO stages to consider: the layout's if pinned, else what the runtime executes on
    ``cfg``'s mesh (support None: every stage the cost model prices, for evaluation)."""
    if layout.zero_stage is not None:
        return (layout.zero_stage,)
    return support.zero_stages_for(cfg.pp, cfg.tp, cfg.dp) if support else ZERO_STAGES


def step_lower_bound_s(traced: TracedModel, cluster, cfg: Config, memo: dict, layout: Layout,
                       support: RuntimeSupport | None, best_s: float,
                       comm: bool = True) -> float:
    """The tightest step-time lower bound (seconds) of :mod:`autopar.planner.bounds` that
    is needed: the compute bound first (no tables), then :func:`step_bound_s` (recompute
    forced by rank 0's memory with the layer's least kept bytes over whole strategy
    choices, a small CP-SAT solve each; the largest rank, exposed DP, optimizer, sends)
    with the layer's least compute, then both with the layer's least time including TP
    communication (a small CP-SAT solve; only when ``comm``), each computed only while the
    bound is below ``best_s``. Pieces per (tp, micro-batch size, dtype, attention, SP) are
    shared in ``memo``."""
    strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, memo)
    key = (cfg.tp, cfg.micro_batch_size, cfg.dtype, cfg.attention, cfg.sequence_parallel)
    if ("compute_s",) + key not in memo:
        memo[("compute_s",) + key] = min_layer_compute_s(traced, strategies, cluster, cfg)
    compute_s = memo[("compute_s",) + key]
    bound = compute_bound_s(traced, cfg, compute_s)
    if bound >= best_s:
        return bound
    tables = cost_tables(traced, strategies, cluster, cfg, memo, template_only=True)
    if ("pieces",) + key not in memo:
        kept = min_layer_kept_bytes(traced, strategies, tables, cluster)
        memo[("pieces",) + key] = layer_pieces(traced, tables, kept)
    modes = RECOMPUTE_MODES if layout.recompute is None else (layout.recompute,)
    modes = tuple(m for m in modes if not support or m in support.recompute)
    zero = zero_choices(layout, support, cfg)

    def step_bound(layer_s: float) -> float:
        return step_bound_s(traced, tables, cfg, layer_s, cluster, zero, modes,
                            memo[("pieces",) + key])
    bound = max(bound, step_bound(compute_s))
    if bound >= best_s or not comm:
        return bound
    if ("comm_s",) + key not in memo:
        memo[("comm_s",) + key] = min_layer_time_s(traced, strategies, tables, cluster)
    layer_s = memo[("comm_s",) + key]
    return max(bound, compute_bound_s(traced, cfg, layer_s), step_bound(layer_s))


def order_bound_s(traced, cluster, cfg: Config, memo: dict, layout: Layout,
                  support: RuntimeSupport | None) -> float:
    """The bound configs are visited in order of (seconds): :func:`step_lower_bound_s`
    without the CP-SAT layer-time bound, or inf when the memory lower bound already says
    it does not fit device memory less the reserve (it is then pruned unsolved, last)."""
    mem_lb, usable = memory_bounds(traced, cluster, cfg, memo, layout, support)
    if mem_lb > usable:
        return float("inf")
    return step_lower_bound_s(traced, cluster, cfg, memo, layout, support, float("inf"),
                              comm=False)


def memory_bounds(traced, cluster, cfg: Config, memo: dict, layout: Layout,
                  support: RuntimeSupport | None) -> tuple[float, float]:
    """(:func:`memory_lower_bound_bytes`, the largest usable bytes of any rank:
    :func:`~autopar.planner.reserve.max_usable_bytes`) of ``cfg``, memoised per config in
    ``memo`` (``traced.total_params()`` once per search)."""
    key = ("memory_lb", cfg)
    if key not in memo:
        if ("total_params",) not in memo:
            memo[("total_params",)] = traced.total_params()
        lb = memory_lower_bound_bytes(traced, cfg, zero_choices(layout, support, cfg),
                                      memo[("total_params",)])
        memo[key] = lb, max_usable_bytes(p2p_bytes(traced, cfg), cluster, cfg)
    return memo[key]


def pruned_entry(traced, cluster, cfg: Config, memo: dict, layout: Layout,
                 support: RuntimeSupport | None, best_t: float) -> dict | None:
    """The ``seen`` entry of a config that need not be solved (the memory lower bound says
    it does not fit in device memory less the reserve, or a step-time bound of
    :func:`step_lower_bound_s` says it cannot fit or cannot beat ``best_t`` seconds), else
    None."""
    mem_lb, usable = memory_bounds(traced, cluster, cfg, memo, layout, support)
    if mem_lb > usable:
        return {"layout": asdict(cfg), "step_time_s": None, "feasible": False,
                "min_memory_bytes": mem_lb,
                "reason": f"needs at least {mem_lb / 2**30:.1f} GiB per GPU > "
                          f"{max(usable, 0.0) / 2**30:.1f} GiB usable "
                          f"({cluster.device.memory_gib:.0f} GiB less the memory reserve)"}
    lb = step_lower_bound_s(traced, cluster, cfg, memo, layout, support, best_t)
    if lb == float("inf"):
        return {"layout": asdict(cfg), "step_time_s": None, "feasible": False,
                "reason": "pipeline rank 0 does not fit memory with any layer count and "
                          "recompute (memory-time lower bound)"}
    if lb >= best_t:
        return {"layout": asdict(cfg), "step_time_s": None, "feasible": None,
                "reason": f"pruned: step-time lower bound {lb:.3f} s >= best {best_t:.3f} s"}
    return None
