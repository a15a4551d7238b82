"""The outer search: mesh shapes and micro-batch sizes, each solved by CP-SAT.

Configs are visited in order of a step-time lower bound (perfect TP split, no
communication; the recompute rank 0's memory forces, the largest rank's layers, the
exposed DP reduction, the optimizer step and the sends: :mod:`autopar.planner.search.bounds`), so
the first plans found are near the best; a config whose bound (tightened, while it is
needed, by the layer's TP communication) is already slower than the best plan found is
skipped (:mod:`autopar.planner.search.pruning`), so the search proves optimality over the
enumerated space without solving every config.
"""

from __future__ import annotations

import heapq
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from autopar.contract import support as support_rules
from autopar.graph.annotate import TracedModel
from autopar.contract.plan import Alternative, Layout, SolverStatus
from autopar.planner.search.configs import candidate_configs, no_config_message, validate_layout
from autopar.planner.costs.tables import Config, CostTables, cost_tables
from autopar.planner.cpsat import ConfigModel, template_map
from autopar.planner.cpsat.terms import fix_strategies, hint_strategies, polish_stages
from autopar.planner.costs.decision import Decision
from autopar.planner.strategies.megatron import allowed_strategies
from autopar.planner.costs.predict import predict
from autopar.planner.search.pruning import (order_bound_s, prefetch_order_bounds, pruned_entry,
                                            step_lower_bound_s, strategies_for, zero_choices)
from autopar.planner.strategies import NodeStrategies
from autopar.planner.costs.cache import SearchCache
from autopar.planner.search.speculate import in_turn
from autopar.planner.search.outcome import (STOPPED, binding_stages, no_plan_error,
                                            solver_status, unsolved)
from autopar.contract.support import RUNTIME_SUPPORT, RuntimeSupport
from autopar.techniques.pipeline_schedules import pipeline_schedule

__all__ = ["candidate_configs", "search", "solve_one", "solve_config", "strategies_for",
           "validate_layout", "zero_choices", "SearchContext", "SearchResult", "Solved",
           "DEFAULT_TIME_LIMIT_S"]

# The CP-SAT objective rounds coefficients to integer units (parameters up to 1024, times
# to ~1e-4 of a layer), so it may overshoot the prediction slightly; a config is only cut
# off when it cannot beat the incumbent by more than this margin, then predict decides.
CUTOFF_SLACK = 0.01
SOLVE_BATCH = 2  # configs solved at once, each with the cutoff from before the batch (fixed,
# not the core count, so the search path and its result are the same on every machine)
ALTERNATIVES = 5  # runner-ups a plan lists (priced by _price_alternatives)
ALTERNATIVE_TIME_LIMIT_S = 0.25  # CP-SAT deterministic time per runner-up priced for the report
DEFAULT_TIME_LIMIT_S = 1.0  # CP-SAT deterministic time per config (``--time-limit``)


@dataclass(frozen=True, kw_only=True)
class SearchContext:
    """What every config of one search shares: the traced model, the cluster, the user's
    pins (``layout``), the space searched (``support``: a runtime's or a target's
    :class:`~autopar.contract.support.RuntimeSupport`, or
    :data:`~autopar.contract.support.FULL_SPACE`: all the cost model prices),
    the template map of the CP-SAT model (:func:`~autopar.planner.cpsat.terms.template_map`),
    whether stages are split evenly as Megatron-LM does (hand layouts), and ``cache``
    (:class:`~autopar.planner.costs.cache.SearchCache`): the strategies, cost tables and
    bounds the configs share (:func:`strategies_for`,
    :func:`~autopar.planner.costs.tables.cost_tables`, :mod:`autopar.planner.search.pruning`).
    Build with :meth:`of`."""

    traced: TracedModel
    cluster: object
    layout: Layout
    support: RuntimeSupport
    mapping: dict
    even_stages: bool = False
    cache: SearchCache = field(default_factory=SearchCache, compare=False, repr=False)

    @classmethod
    def of(cls, traced: TracedModel, cluster, layout: Layout,
           support: RuntimeSupport = RUNTIME_SUPPORT,
           even_stages: bool = False) -> SearchContext:
        """The context of a search of ``traced`` on ``cluster`` inside ``support``."""
        return cls(traced=traced, cluster=cluster, layout=layout, support=support,
                   mapping=template_map(traced), even_stages=even_stages)


@dataclass
class SearchResult:
    """The best decision, its tables, every config the search looked at, what the search
    proved (:class:`~autopar.contract.plan.SolverStatus`) and its wall time."""

    decision: Decision | None
    tables: CostTables
    strategies: NodeStrategies
    seen: list[Alternative]
    solve_time_s: float
    solver: SolverStatus = SolverStatus()


@dataclass
class Solved:
    """One config's CP-SAT solve: the decision (None unless OPTIMAL or FEASIBLE), CP-SAT's
    status name, the tables and strategies it priced, its objective bound in seconds (a
    lower bound on the config's step time in the solver's units) and the model."""

    decision: Decision | None
    status: str
    tables: CostTables
    strategies: NodeStrategies
    bound_s: float
    model: ConfigModel


def solve_config(ctx: SearchContext, cfg: Config, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 cutoff_s: float | None = None, assume_memory: bool = False,
                 hint: dict[str, int] | None = None,
                 fixed: dict[str, int] | None = None) -> Solved:
    """Solve one Config of the search ``ctx`` with CP-SAT
    (:class:`~autopar.planner.cpsat.ConfigModel`) within ``time_limit_s`` seconds of
    deterministic time, only for plans faster than ``cutoff_s`` seconds when given;
    ``assume_memory``: memory rows behind assumption literals (to name binding stages);
    ``hint``: strategy indices per node to try first (:func:`hint_strategies`). A solve
    stopped at the limit (FEASIBLE) is polished (:func:`polish_stages`: its stages, recompute
    and ZeRO stage re-solved for the strategies it chose); its status and bound stay the
    joint solve's. ``fixed``: strategy indices per node the plan must take
    (:func:`fix_strategies`; its bound then holds for those strategies only)."""
    from ortools.sat.python import cp_model

    traced, cluster, layout, support, cache = (ctx.traced, ctx.cluster, ctx.layout, ctx.support,
                                               ctx.cache)
    strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, cache, cfg.ep)
    tables = cost_tables(traced, strategies, cluster, cfg, cache)
    zero = zero_choices(layout, support, cfg)
    modes = pipeline_schedule(cfg.schedule).recompute_modes(support.recompute)
    model = ConfigModel(traced, strategies, tables, cluster, zero_stages=zero,
                        allowed=allowed_strategies(traced, strategies, cfg.tp,
                                                   cfg.sequence_parallel, cache, support,
                                                   cfg.ep),
                        recompute_modes=modes, fixed_recompute=layout.recompute,
                        even_stages=ctx.even_stages or support.even_stages,
                        recompute_layout=support.recompute_layout,
                        assume_memory=assume_memory)
    model.build()
    if cutoff_s is not None and cutoff_s < float("inf"):
        model.add_cutoff(cutoff_s)
    if hint:
        hint_strategies(model, hint)
    if fixed:
        fix_strategies(model, fixed)
    if assume_memory:
        return Solved(None, "", tables, strategies, 0.0, model)
    status, solver = model.solve(time_limit_s)
    bound_s = max(0.0, solver.BestObjectiveBound() / model.units_per_second / cfg.virtual_stages)
    if status == cp_model.FEASIBLE:  # stopped short: the stages' best for its strategies;
        # the status stays FEASIBLE (nothing is proven for the config)
        solver = (polish_stages(model, solver, time_limit_s) or (status, solver))[1]
    decision = (model.decision(solver, ctx.mapping)
                if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None)
    return Solved(decision, solver.StatusName(status), tables, strategies, bound_s, model)


def solve_one(ctx: SearchContext, cfg: Config, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
              cutoff_s: float | None = None):
    """:func:`solve_config` as (Decision | None, CP-SAT status name, tables, strategies):
    None unless the status is OPTIMAL or FEASIBLE (FEASIBLE: stopped at the limit, not
    proven optimal)."""
    out = solve_config(ctx, cfg, time_limit_s=time_limit_s, cutoff_s=cutoff_s)
    return out.decision, out.status, out.tables, out.strategies


def search(traced: TracedModel, cluster, global_batch_size: int, layout: Layout,
           support: RuntimeSupport = RUNTIME_SUPPORT,
           even_stages: bool = False,
           progress: Callable[[int, int, float | None], None] | None = None,
           time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> SearchResult:
    """Branch and bound over the configs of :func:`candidate_configs` for ``traced`` on
    ``cluster`` with B = ``global_batch_size``: configs in order of a compute lower bound
    (seconds), each pruned by that bound or the memory lower bound (bytes) or solved by
    CP-SAT (``time_limit_s`` of deterministic time each) with the best step time so far as
    cutoff, then priced by ``predict``; configs that reach CP-SAT are solved
    :data:`SOLVE_BATCH` at a time on threads (the first alone, so that the others get its
    cutoff), each batch with the cutoff from before it and hinted with the strategies of
    the last plan of an earlier batch with the same (tp, SP, micro-batch size, dtype,
    attention), and read back in order (deterministic).
    ``even_stages``: layers split evenly as Megatron does (hand layouts). The result's
    ``solver`` says what was proven (:mod:`autopar.planner.search.outcome`).

    Raises ValueError (:func:`validate_layout`, or no config fits the layout: the message
    names the rule), InfeasibleError when every config is proven not to fit, naming the
    binding stage, and SolverTimeLimitError when CP-SAT stopped at its time limit without
    any plan.

    progress: called as ``progress(visited, total, best_step_time_s)`` before each of the
        ``total`` configs (mesh shape and micro-batch size) is solved or pruned, and once
        more with ``visited == total`` at the end; best_step_time_s is the best predicted
        step time found so far in seconds, None while nothing fits. It only observes: the
        result does not depend on it.
    """
    start = time.perf_counter()
    validate_layout(traced, cluster, layout, global_batch_size)
    if not support.as_written:
        support_rules.check_pins(layout, support)
    ctx = SearchContext.of(traced, cluster, layout, support, even_stages)
    why: dict[str, str] = {}
    configs = candidate_configs(traced, cluster, global_batch_size, layout, support, why)
    if not configs:
        raise ValueError(no_config_message(cluster, global_batch_size, layout, why))
    with ThreadPoolExecutor(SOLVE_BATCH) as pool:  # the order bounds' CP-SAT solves
        prefetch_order_bounds(traced, cluster, configs, ctx.cache, layout, support, pool)
    bound = {c: order_bound_s(traced, cluster, c, ctx.cache, layout, support) for c in configs}
    configs.sort(key=bound.get)  # stable: equal bounds keep candidate_configs' order
    best, seen, statuses, lower, hints = _Best(), [], {}, {}, {}

    def take(cfg: Config, out: Solved, cutoff: float) -> None:
        cut = cutoff if out.status == "INFEASIBLE" and cutoff < float("inf") else 0.0
        statuses[cfg], lower[cfg] = out.status, max(out.bound_s, bound[cfg], cut)
        if out.decision is not None:
            hints[_hint_key(cfg)] = out.decision.strategy
        entry = _entry(traced, cluster, cfg, out, cutoff, global_batch_size, best)
        old = next((k for k, s in enumerate(seen) if s.layout == entry.layout), None)
        if old is None:
            seen.append(entry)
        else:  # a stopped config solved again under the cutoff replaces its first record
            seen[old] = entry

    with ThreadPoolExecutor(SOLVE_BATCH) as pool:  # CP-SAT releases the GIL while it solves
        i = 0
        while i < len(configs):
            batch, cutoff = [], best.step_s
            size = 1 if i == 0 else SOLVE_BATCH  # the first alone: the rest get its cutoff
            while i < len(configs) and len(batch) < size:
                cfg, i = configs[i], i + 1
                if progress is not None:
                    progress(len(seen) + len(batch), len(configs), best.found_s)
                pruned = pruned_entry(traced, cluster, cfg, ctx.cache, layout, support, best.step_s)
                if pruned is None:
                    batch.append((cfg, pool.submit(
                        solve_config, ctx, cfg, time_limit_s=time_limit_s,
                        cutoff_s=cutoff * (1 + CUTOFF_SLACK), hint=hints.get(_hint_key(cfg)))))
                else:
                    seen.append(pruned)
            for cfg, future in batch:  # in config order: the result never depends on timing
                take(cfg, future.result(), cutoff)
    # a config CP-SAT stopped at its time limit (often one solved before any cutoff) is
    # solved once more with the best plan's cutoff, which prunes its search, in visit order
    # (each with the cutoff and hint the loop would give it, the next solved ahead: in_turn)
    with ThreadPoolExecutor(SOLVE_BATCH) as pool:
        in_turn([c for c in configs if statuses.get(c) in STOPPED],
                lambda cfg: (best.step_s, hints.get(_hint_key(cfg)))
                if lower[cfg] < best.step_s else None,
                lambda cfg, args: solve_config(ctx, cfg, time_limit_s=time_limit_s,
                                               cutoff_s=args[0] * (1 + CUTOFF_SLACK),
                                               hint=args[1]),
                lambda cfg, args, out: take(cfg, out, args[0]), pool, SOLVE_BATCH)
    best, best_t, best_tab = best.decision, best.step_s, best.tables
    if progress is not None:
        progress(len(seen), len(configs), best_t if best is not None else None)
    if best is None:
        raise no_plan_error(cluster, seen, statuses, time_limit_s, _binding(ctx, statuses))
    _price_alternatives(ctx, global_batch_size, seen, hints, lower)
    status = solver_status(best_t, statuses, lower, len(configs), time_limit_s)
    return SearchResult(best, best_tab[0], best_tab[1], seen, time.perf_counter() - start,
                        status)


def _hint_key(cfg: Config) -> tuple:
    """The configs whose plans hint each other's solves (the same strategies and prices)."""
    return cfg.tp, cfg.sequence_parallel, cfg.micro_batch_size, cfg.dtype, cfg.attention


@dataclass
class _Best:
    """The incumbent of a search: decision, predicted step seconds (inf: none yet) and its
    (tables, strategies)."""

    decision: Decision | None = None
    step_s: float = float("inf")
    tables: tuple | None = None

    @property
    def found_s(self) -> float | None:
        """The step seconds, None while nothing fits (what ``progress`` reports)."""
        return self.step_s if self.decision is not None else None


def _entry(traced, cluster, cfg: Config, out: Solved, cutoff: float, global_batch_size: int,
           best: _Best) -> Alternative:
    """The ``seen`` record of a solved config (its plan priced by ``predict``, or why it
    has none given ``cutoff``), making its plan the incumbent ``best`` when faster."""
    if out.decision is None:
        feasible, reason = unsolved(out.status, cutoff)
        return Alternative(layout=asdict(cfg), feasible=feasible, reason=reason)
    pred = predict(traced, out.strategies, out.tables, cluster, out.decision,
                   global_batch_size=global_batch_size)
    if pred.step_time_s < best.step_s:
        best.decision, best.step_s = out.decision, pred.step_time_s
        best.tables = (out.tables, out.strategies)
    return Alternative(layout=asdict(cfg), feasible=True, step_time_s=pred.step_time_s,
                       tflops_per_gpu=pred.tflops_per_gpu,
                       peak_memory_bytes=pred.peak_memory_bytes)


def _binding(ctx: SearchContext, statuses: dict) -> str | None:
    """The stages in CP-SAT's infeasible core for the INFEASIBLE config whose mesh holds
    the fewest parameters per GPU (the most memory-frugal one), as text; None if none."""
    infeasible = [c for c, s in statuses.items() if s == "INFEASIBLE"]
    if not infeasible:
        return None
    cfg = min(infeasible, key=lambda c: (1 / (c.tp * c.pp), c.micro_batch_size))
    model = solve_config(ctx, cfg, assume_memory=True).model
    stages = binding_stages(model)
    if not stages:
        return None
    rows = ", ".join(f"memory[stage {i}]" for i in stages)
    return (f"{rows} of tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} mbs={cfg.micro_batch_size} "
            f"{cfg.schedule}")


def _price_alternatives(ctx: SearchContext, global_batch_size: int, seen: list[Alternative],
                        hints: dict, known_lower: dict, count: int = ALTERNATIVES,
                        time_limit_s: float = ALTERNATIVE_TIME_LIMIT_S) -> None:
    """Solve without a cutoff the configs the search never priced (cut off by CP-SAT or
    pruned by a bound), those with the least step-time lower bound first
    (:func:`~autopar.planner.search.pruning.step_lower_bound_s`, TP communication included), so
    the report can show how much slower the nearest ones are, until ``count``
    runner-ups have a plan (those the search priced on its way count), each within
    ``time_limit_s`` of deterministic time, hinted with the search's plan of the same
    (tp, SP, micro-batch size, dtype, attention) from ``hints``, :data:`SOLVE_BATCH` at a
    time (read back in order): a plan CP-SAT did not prove optimal is marked "slower (not
    proven optimal: CP-SAT stopped at its time limit; no plan of this config beats X s)",
    X the largest of CP-SAT's objective bound, the step-time lower bound and what the
    search proved (``known_lower``: seconds per Config, e.g. a cutoff CP-SAT could not
    beat)."""
    missing = max(0, count + 1 - sum(1 for s in seen if s.feasible))  # the best is not one
    lower = _least_lower_bounds(ctx, seen, known_lower, missing)
    entries = sorted(lower, key=lambda k: (lower[k], k))[:missing]  # indices into seen
    with ThreadPoolExecutor(SOLVE_BATCH) as pool:
        futures = [pool.submit(_runner_up, ctx, cfg, time_limit_s, hints.get(_hint_key(cfg)))
                   for cfg in (Config(**seen[k].layout) for k in entries)]
    for k, future in zip(entries, futures):
        out, priced = future.result()
        decision, status, tables, strategies = (priced.decision, out.status, priced.tables,
                                                priced.strategies)
        if decision is None:
            feasible, reason = unsolved(status, float("inf"))
            seen[k] = replace(seen[k], feasible=feasible, reason=reason)
            continue
        pred = predict(ctx.traced, strategies, tables, ctx.cluster, decision,
                       global_batch_size=global_batch_size)
        floor_s = max(out.bound_s, lower[k])
        seen[k] = replace(seen[k], step_time_s=pred.step_time_s, feasible=True,
                          tflops_per_gpu=pred.tflops_per_gpu,
                          peak_memory_bytes=pred.peak_memory_bytes,
                          reason="slower" if status == "OPTIMAL" else
                          "slower (not proven optimal: CP-SAT stopped at its time limit; no "
                          f"plan of this config beats {floor_s:.4g} s)")


def _runner_up(ctx: SearchContext, cfg: Config, time_limit_s: float,
               hint: dict[str, int] | None) -> tuple[Solved, Solved]:
    """(the joint solve of a runner-up ``cfg`` hinted with ``hint``, the solve whose plan it
    reports): the joint one, or when that found none in ``time_limit_s`` (UNKNOWN) and the
    search has a plan of the same strategies' key, the best stages for those strategies
    (``fixed``: a small model, :func:`polish_stages`); the joint solve's bound stays the
    config's floor."""
    out = solve_config(ctx, cfg, time_limit_s=time_limit_s, hint=hint)
    if out.decision is None and out.status == "UNKNOWN" and hint:
        return out, solve_config(ctx, cfg, time_limit_s=time_limit_s, fixed=hint)
    return out, out


def _least_lower_bounds(ctx: SearchContext, seen: list[Alternative], known_lower: dict,
                        count: int) -> dict[int, float]:
    """Index in ``seen`` -> step-time lower bound (seconds: the largest of ``known_lower``
    and :func:`~autopar.planner.search.pruning.step_lower_bound_s` with TP communication)
    of the unpriced configs (``feasible is None``), for at least the ``count`` least of them
    (ties: the earlier index). The bounds are computed in order of the bound without TP
    communication (never larger; its pieces are those the search ordered its configs by),
    until that bound exceeds the ``count``-th least found: the configs left out cannot be
    among the ``count`` least, so their CP-SAT layer-time solves are skipped."""
    if count <= 0:
        return {}

    def bound(k: int, comm: bool) -> float:
        cfg = Config(**seen[k].layout)
        return max(known_lower.get(cfg, 0.0), step_lower_bound_s(
            ctx.traced, ctx.cluster, cfg, ctx.cache, ctx.layout, ctx.support, float("inf"),
            comm=comm))
    cheap = {k: bound(k, False) for k, s in enumerate(seen) if s.feasible is None}
    lower: dict[int, float] = {}
    least: list[float] = []  # the count least bounds found, negated (a max-heap)
    for k in sorted(cheap, key=lambda k: (cheap[k], k)):
        if len(least) == count and cheap[k] > -least[0]:
            break
        lower[k] = bound(k, True)
        heapq.heappush(least, -lower[k])
        if len(least) > count:
            heapq.heappop(least)
    return lower
