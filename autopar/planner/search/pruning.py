"""Which configs of a search need no CP-SAT solve (step 3 of the flow, before CP-SAT).

:func:`order_bound_s` is the bound the search visits configs in; :func:`pruned_entry`
decides, given the best step time found so far, whether a config can be skipped: its
memory lower bound exceeds device memory less the reserve, or a step-time lower bound of
:mod:`autopar.planner.search.bounds` (with the layer's least time and least kept bytes over whole
strategy choices, :mod:`autopar.planner.search.layer_bounds`) is no better than the best. Pieces
shared by the configs of one search live in its
:class:`~autopar.planner.costs.cache.SearchCache`.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import asdict

from autopar.graph.annotate import TracedModel
from autopar.contract.plan import RECOMPUTE_MODES, Alternative, Layout
from autopar.planner.search.bounds import (compute_bound_s, expert_params, layer_pieces,
                                           memory_lower_bound_bytes, min_layer_compute_s,
                                           step_bound_s)
from autopar.planner.costs.tables import Config, cost_tables
from autopar.planner.search.layer_bounds import min_layer_kept_bytes, min_layer_time_s
from autopar.planner.costs.reserve import max_usable_bytes, p2p_bytes
from autopar.planner.costs.cache import SearchCache
from autopar.planner.strategies import node_strategies
from autopar.contract.support import RuntimeSupport

__all__ = ["strategies_for", "zero_choices", "step_lower_bound_s", "order_bound_s",
           "prefetch_order_bounds", "memory_bounds", "pruned_entry"]


def strategies_for(traced: TracedModel, tp: int, sequence_parallel: bool, cache: SearchCache,
                   ep: int = 1):
    """:func:`~autopar.planner.strategies.node_strategies`, computed once per (tp,
    sequence_parallel, experts on the TP ranks' tokens) in ``cache`` (one search: every
    config of a TP size shares them)."""
    return cache.strategies(tp, sequence_parallel,
                            lambda: node_strategies(traced, tp, sequence_parallel, ep), ep)


def zero_choices(layout: Layout, support: RuntimeSupport, cfg: Config) -> tuple[int, ...]:
    """ZeRO stages to consider: the layout's if pinned, else what ``support`` executes on
    ``cfg``'s mesh (:data:`~autopar.contract.support.FULL_SPACE`: every stage the cost model
    prices, for evaluation)."""
    if layout.zero_stage is not None:
        return (layout.zero_stage,)
    stages = support.zero_stages_for(cfg.pp, cfg.tp, cfg.dp)
    return tuple(z for z in stages if z in support.expert_zero_stages) if cfg.ep > 1 \
        else stages  # EP: the stages the runner shards expert states with


def step_lower_bound_s(traced: TracedModel, cluster, cfg: Config, cache: SearchCache,
                       layout: Layout,
                       support: RuntimeSupport, best_s: float,
                       comm: bool = True) -> float:
    """The tightest step-time lower bound (seconds) of :mod:`autopar.planner.search.bounds` that
    is needed: the compute bound first (no tables), then :func:`step_bound_s` (recompute
    forced by rank 0's memory with the layer's least kept bytes over whole strategy
    choices, a small CP-SAT solve each; the largest rank, exposed DP, optimizer, sends)
    with the layer's least compute, then both with the layer's least time including TP
    communication (a small CP-SAT solve; only when ``comm``), each computed only while the
    bound is below ``best_s``. Pieces per (tp, micro-batch size, dtype, attention, SP) are
    shared in ``cache``."""
    strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, cache, cfg.ep)
    key = (cfg.tp, cfg.micro_batch_size, cfg.dtype, cfg.attention, cfg.sequence_parallel,
           cfg.ep)
    compute_s = cache.layer_compute_s(
        key, lambda: min_layer_compute_s(traced, strategies, cluster, cfg))
    bound = compute_bound_s(traced, cfg, compute_s)
    if bound >= best_s:
        return bound
    tables = cost_tables(traced, strategies, cluster, cfg, cache, template_only=True)
    pieces = cache.layer_pieces(key, lambda: layer_pieces(
        traced, tables, _layer_kept_bytes(traced, strategies, tables, cluster, cache),
        cache.graph_index(lambda: {n.name: n for n in traced.gm.graph.nodes})))
    modes = RECOMPUTE_MODES if layout.recompute is None else (layout.recompute,)
    modes = tuple(m for m in modes if m in support.recompute)
    zero = zero_choices(layout, support, cfg)

    def step_bound(layer_s: float) -> float:
        return step_bound_s(traced, tables, cfg, layer_s, cluster, zero, modes, pieces)
    bound = max(bound, step_bound(compute_s))
    if bound >= best_s or not comm:
        return bound
    layer_s = cache.layer_time_s(key, lambda: min_layer_time_s(traced, strategies, tables,
                                                               cluster))
    return max(bound, compute_bound_s(traced, cfg, layer_s), step_bound(layer_s))


def _kept_key(traced: TracedModel, strategies, tables) -> tuple:
    """What :func:`~autopar.planner.search.layer_bounds.min_layer_kept_bytes` of ``tables``
    reads (:meth:`SearchCache.layer_kept_bytes`): the strategies and the edge tables, by
    identity (the search's cache holds one object per answer and keeps it alive, so the
    same object is the same answer), and the saved bytes of the template layer's nodes,
    so a shared answer is the one a fresh solve gives. Configs that differ in ep alone
    share the strategies and edges, and their nodes keep the same bytes."""
    cfg = tables.config
    saved = tuple((c.saved_bytes, c.core_saved_bytes)
                  for n in traced.layers[0] for c in tables.node[n])
    return (cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, cfg.activation_bytes,
            cfg.attention, id(strategies), tuple(map(id, tables.edge.values())), saved)


def _layer_kept_bytes(traced: TracedModel, strategies, tables, cluster,
                      cache: SearchCache) -> tuple[float, float]:
    """:func:`~autopar.planner.search.layer_bounds.min_layer_kept_bytes` of ``tables``, once
    per :func:`_kept_key`."""
    return cache.layer_kept_bytes(_kept_key(traced, strategies, tables),
                                  lambda: min_layer_kept_bytes(traced, strategies, tables,
                                                               cluster))


def prefetch_order_bounds(traced, cluster, configs: list[Config], cache: SearchCache,
                          layout: Layout, support: RuntimeSupport, pool: Executor) -> None:
    """Solve on ``pool``'s threads, into ``cache``, the CP-SAT models of the layer's least
    kept bytes that :func:`order_bound_s` of ``configs`` will read (those whose memory lower
    bound fits), one per :func:`_kept_key`: CP-SAT releases the GIL while it solves, so one
    model is built while another solves. The answers are those :func:`order_bound_s`
    would compute itself (each solve is deterministic and independent of the others)."""
    jobs: dict[tuple, Future] = {}
    priced: set[tuple] = set()  # the tables' keys (tp, micro-batch size, dtype, ...) seen
    for cfg in configs:
        mem_lb, usable = memory_bounds(traced, cluster, cfg, cache, layout, support)
        pricing = (cfg.tp, cfg.micro_batch_size, cfg.dtype, cfg.attention,
                   cfg.sequence_parallel, cfg.ep)
        if mem_lb > usable or pricing in priced:
            continue
        priced.add(pricing)
        strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, cache, cfg.ep)
        tables = cost_tables(traced, strategies, cluster, cfg, cache, template_only=True)
        key = _kept_key(traced, strategies, tables)
        if key not in jobs:
            jobs[key] = pool.submit(min_layer_kept_bytes, traced, strategies, tables, cluster)
    for key, job in jobs.items():
        cache.layer_kept_bytes(key, job.result)


def order_bound_s(traced, cluster, cfg: Config, cache: SearchCache, layout: Layout,
                  support: RuntimeSupport) -> float:
    """The bound configs are visited in order of (seconds): :func:`step_lower_bound_s`
    without the CP-SAT layer-time bound, or inf when the memory lower bound already says
    it does not fit device memory less the reserve (it is then pruned unsolved, last)."""
    mem_lb, usable = memory_bounds(traced, cluster, cfg, cache, layout, support)
    if mem_lb > usable:
        return float("inf")
    return step_lower_bound_s(traced, cluster, cfg, cache, layout, support, float("inf"),
                              comm=False)


def memory_bounds(traced, cluster, cfg: Config, cache: SearchCache, layout: Layout,
                  support: RuntimeSupport) -> tuple[float, float]:
    """(:func:`memory_lower_bound_bytes`, the largest usable bytes of any rank:
    :func:`~autopar.planner.costs.reserve.max_usable_bytes`) of ``cfg``, kept per config in
    ``cache`` (``traced.total_params()`` once per search)."""
    def compute() -> tuple[float, float]:
        total = cache.total_params(traced.total_params)
        experts = cache.expert_params(lambda: expert_params(traced)) if cfg.ep > 1 else None
        lb = memory_lower_bound_bytes(traced, cfg, zero_choices(layout, support, cfg), total,
                                      experts)
        return lb, max_usable_bytes(p2p_bytes(traced, cfg), cluster, cfg)
    return cache.memory_bounds(cfg, compute)


def pruned_entry(traced, cluster, cfg: Config, cache: SearchCache, layout: Layout,
                 support: RuntimeSupport, best_t: float) -> Alternative | None:
    """The search's record of a config that need not be solved (the memory lower bound says
    it does not fit in device memory less the reserve, or a step-time bound of
    :func:`step_lower_bound_s` says it cannot fit or cannot beat ``best_t`` seconds), else
    None."""
    mem_lb, usable = memory_bounds(traced, cluster, cfg, cache, layout, support)
    if mem_lb > usable:
        return Alternative(layout=asdict(cfg), feasible=False, min_memory_bytes=mem_lb,
                           reason=f"needs at least {mem_lb / 2**30:.1f} GiB per GPU > "
                                  f"{max(usable, 0.0) / 2**30:.1f} GiB usable "
                                  f"({cluster.device.memory_gib:.0f} GiB less the memory "
                                  "reserve)")
    lb = step_lower_bound_s(traced, cluster, cfg, cache, layout, support, best_t)
    if lb == float("inf"):
        return Alternative(layout=asdict(cfg), feasible=False,
                           reason="pipeline rank 0 does not fit memory with any layer count "
                                  "and recompute (memory-time lower bound)")
    if lb >= best_t:
        return Alternative(layout=asdict(cfg), feasible=None,
                           reason=f"pruned: step-time lower bound {lb:.3f} s >= best "
                                  f"{best_t:.3f} s")
    return None
