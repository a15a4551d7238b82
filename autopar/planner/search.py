"""The outer search: mesh shapes and micro-batch sizes, each solved by CP-SAT.

Configs are visited in order of a compute lower bound (perfect TP split, no communication,
no bubble); a config whose bound (tightened, while it is needed, by the layer's TP
communication and the recompute its memory forces: :mod:`autopar.planner.bounds`) is
already slower than the best plan found is skipped, so the search proves optimality over
the enumerated space without solving every config.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

from autopar import support as support_rules
from autopar.graph.annotate import TracedModel
from autopar.plan import RECOMPUTE_MODES, ZERO_STAGES, Layout, SolverStatus
from autopar.planner.bounds import (compute_bound_s, memory_lower_bound_bytes, memory_time_bound_s,
                                    min_layer_compute_s)
from autopar.planner.configs import candidate_configs, no_config_message, validate_layout
from autopar.planner.cost_tables import Config, cost_tables
from autopar.planner.cpsat import ConfigModel, min_layer_time_s, template_map
from autopar.planner.decision import Decision
from autopar.planner.predict import predict
from autopar.planner.reserve import max_usable_bytes, p2p_bytes, usable_bytes
from autopar.planner.search_outcome import (binding_stages, no_plan_error, solver_status,
                                            unsolved)
from autopar.planner.strategies import node_strategies
from autopar.support import RUNTIME_SUPPORT, RuntimeSupport

__all__ = ["candidate_configs", "search", "solve_one", "solve_config", "strategies_for",
           "validate_layout", "SearchResult", "Solved", "DEFAULT_TIME_LIMIT_S"]

# The CP-SAT objective rounds coefficients to integer units (parameters up to 1024, times
# to ~1e-4 of a layer), so it may overshoot the prediction slightly; a config is only cut
# off when it cannot beat the incumbent by more than this margin, then predict decides.
CUTOFF_SLACK = 0.01
SOLVE_BATCH = 2  # configs solved at once, each with the cutoff from before the batch (fixed,
# not the core count, so the search path and its result are the same on every machine)
ALTERNATIVE_TIME_LIMIT_S = 0.25  # CP-SAT deterministic time per runner-up priced for the report
DEFAULT_TIME_LIMIT_S = 1.0  # CP-SAT deterministic time per config (``--time-limit``)


def strategies_for(traced: TracedModel, tp: int, sequence_parallel: bool, memo: dict):
    """:func:`~autopar.planner.strategies.node_strategies`, computed once per (tp,
    sequence_parallel) in ``memo`` (one search: every config of a TP size shares them)."""
    key = ("strategies", tp, sequence_parallel)
    if key not in memo:
        memo[key] = node_strategies(traced, tp, sequence_parallel)
    return memo[key]


def _bounds(traced: TracedModel, cluster, cfg: Config, memo: dict, layout: Layout,
            support: RuntimeSupport | None, best_s: float) -> float:
    """The tightest step-time lower bound (seconds) of :mod:`autopar.planner.bounds` that
    is needed: the cheap compute bound first, then with the layer's TP communication and the
    recompute rank 0's memory forces, each computed only while the bound is below
    ``best_s`` (per (tp, micro-batch size) pieces are shared in ``memo``)."""
    strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, memo)
    key = (cfg.tp, cfg.micro_batch_size, cfg.dtype, cfg.attention, cfg.sequence_parallel)
    if ("compute_s",) + key not in memo:
        memo[("compute_s",) + key] = min_layer_compute_s(traced, strategies, cluster, cfg)
    bound = compute_bound_s(traced, cfg, memo[("compute_s",) + key])
    if bound >= best_s:
        return bound
    tables = cost_tables(traced, strategies, cluster, cfg, memo)
    if ("comm_s",) + key not in memo:
        memo[("comm_s",) + key] = min_layer_time_s(traced, strategies, tables, cluster)
    layer_s = memo[("comm_s",) + key]
    bound = max(bound, compute_bound_s(traced, cfg, layer_s))
    if bound >= best_s:
        return bound
    modes = RECOMPUTE_MODES if layout.recompute is None else (layout.recompute,)
    modes = tuple(m for m in modes if not support or m in support.recompute)
    return max(bound, memory_time_bound_s(traced, tables, cfg, layer_s,
                                          usable_bytes(tables.p2p_bytes, cluster, cfg, 0),
                                          zero_choices(layout, support, cfg.pp), modes))


@dataclass
class SearchResult:
    """The best decision, its tables, every config the search looked at, what the search
    proved (:class:`~autopar.plan.SolverStatus`) and its wall time."""

    decision: Decision | None
    tables: object
    strategies: object
    seen: list[dict]
    solve_time_s: float
    solver: SolverStatus = SolverStatus()


def zero_choices(layout: Layout, support: RuntimeSupport | None, pp: int) -> tuple[int, ...]:
    """ZeRO stages to consider: the layout's if pinned, else what the runtime executes with
    ``pp`` stages (support None: every stage the cost model prices, for evaluation)."""
    if layout.zero_stage is not None:
        return (layout.zero_stage,)
    return support.zero_stages_for(pp) if support else ZERO_STAGES


@dataclass
class Solved:
    """One config's CP-SAT solve: the decision (None unless OPTIMAL or FEASIBLE), CP-SAT's
    status name, the tables and strategies it priced, its objective bound in seconds (a
    lower bound on the config's step time in the solver's units) and the model."""

    decision: Decision | None
    status: str
    tables: object
    strategies: object
    bound_s: float
    model: ConfigModel


def solve_config(traced, cluster, cfg: Config, layout: Layout, support: RuntimeSupport | None,
                 mapping, time_limit_s: float = DEFAULT_TIME_LIMIT_S, even_stages: bool = False,
                 cutoff_s: float | None = None, memo: dict | None = None,
                 assume_memory: bool = False) -> Solved:
    """Solve one Config with CP-SAT (:class:`~autopar.planner.cpsat.ConfigModel`) within
    ``time_limit_s`` seconds of deterministic time, only for plans faster than ``cutoff_s``
    seconds when given; ``mapping``: :func:`~autopar.planner.cpsat_terms.template_map`;
    ``memo``: strategies and cost tables shared by the configs of one search
    (:func:`strategies_for`, :func:`~autopar.planner.cost_tables.cost_tables`);
    ``assume_memory``: memory rows behind assumption literals (to name binding stages)."""
    from ortools.sat.python import cp_model

    memo = {} if memo is None else memo
    strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, memo)
    tables = cost_tables(traced, strategies, cluster, cfg, memo)
    zero = zero_choices(layout, support, cfg.pp)
    modes = support.recompute if support else RECOMPUTE_MODES
    model = ConfigModel(traced, strategies, tables, cluster, zero_stages=zero,
                        recompute_modes=modes, fixed_recompute=layout.recompute,
                        even_stages=even_stages, assume_memory=assume_memory)
    model.build()
    if cutoff_s is not None and cutoff_s < float("inf"):
        model.add_cutoff(cutoff_s)
    if assume_memory:
        return Solved(None, "", tables, strategies, 0.0, model)
    status, solver = model.solve(time_limit_s)
    bound_s = max(0.0, solver.BestObjectiveBound() / model.units_per_second / cfg.virtual_stages)
    decision = (model.decision(solver, mapping)
                if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None)
    return Solved(decision, solver.StatusName(status), tables, strategies, bound_s, model)


def solve_one(traced, cluster, cfg: Config, layout: Layout, support: RuntimeSupport | None,
              mapping, time_limit_s: float = DEFAULT_TIME_LIMIT_S, even_stages: bool = False,
              cutoff_s: float | None = None, memo: dict | None = None):
    """:func:`solve_config` as (Decision | None, CP-SAT status name, tables, strategies):
    None unless the status is OPTIMAL or FEASIBLE (FEASIBLE: stopped at the limit, not
    proven optimal)."""
    out = solve_config(traced, cluster, cfg, layout, support, mapping, time_limit_s,
                       even_stages, cutoff_s, memo)
    return out.decision, out.status, out.tables, out.strategies


def search(traced: TracedModel, cluster, global_batch_size: int, layout: Layout,
           support: RuntimeSupport | None = RUNTIME_SUPPORT,
           even_stages: bool = False,
           progress: Callable[[int, int, float | None], None] | None = None,
           time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> SearchResult:
    """Branch and bound over the configs of :func:`candidate_configs` for ``traced`` on
    ``cluster`` with B = ``global_batch_size``: configs in order of a compute lower bound
    (seconds), each pruned by that bound or the memory lower bound (bytes) or solved by
    CP-SAT (``time_limit_s`` of deterministic time each) with the best step time so far as
    cutoff, then priced by ``predict``; configs that reach CP-SAT are solved
    :data:`SOLVE_BATCH` at a time on threads, each batch with the cutoff from before it,
    and read back in order (deterministic). ``even_stages``: layers split evenly as
    Megatron does (hand layouts). The result's ``solver`` says what was proven
    (:mod:`autopar.planner.search_outcome`).

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
    if support is not None:
        support_rules.check_pins(layout, support)
    mapping = template_map(traced)
    why: dict[str, str] = {}
    configs = candidate_configs(traced, cluster, global_batch_size, layout, support, why)
    if not configs:
        raise ValueError(no_config_message(cluster, global_batch_size, layout, why))
    memo: dict = {}
    bound = {c: _bounds(traced, cluster, c, memo, layout, support, 0.0) for c in configs}
    configs.sort(key=bound.get)
    best, best_t, best_tab, seen, statuses, lower = None, float("inf"), None, [], {}, {}
    with ThreadPoolExecutor(SOLVE_BATCH) as pool:  # CP-SAT releases the GIL while it solves
        i = 0
        while i < len(configs):
            batch, cutoff = [], best_t
            while i < len(configs) and len(batch) < SOLVE_BATCH:
                cfg, i = configs[i], i + 1
                if progress is not None:
                    progress(len(seen) + len(batch), len(configs),
                             best_t if best is not None else None)
                pruned = _pruned(traced, cluster, cfg, memo, layout, support, best_t)
                if pruned is None:
                    batch.append((cfg, pool.submit(
                        solve_config, traced, cluster, cfg, layout, support, mapping,
                        time_limit_s, even_stages, cutoff * (1 + CUTOFF_SLACK), memo)))
                else:
                    seen.append(pruned)
            for cfg, future in batch:  # in config order: the result never depends on timing
                out = future.result()
                statuses[cfg], lower[cfg] = out.status, max(out.bound_s, bound[cfg])
                if out.decision is None:
                    feasible, reason = unsolved(out.status, cutoff)
                    seen.append({"layout": asdict(cfg), "step_time_s": None,
                                 "feasible": feasible, "reason": reason})
                    continue
                pred = predict(traced, out.strategies, out.tables, cluster, out.decision,
                               global_batch_size=global_batch_size)
                seen.append({"layout": asdict(cfg), "step_time_s": pred.step_time_s,
                             "feasible": True, "tflops_per_gpu": pred.tflops_per_gpu,
                             "peak_memory_bytes": pred.peak_memory_bytes, "reason": ""})
                if pred.step_time_s < best_t:
                    best, best_t = out.decision, pred.step_time_s
                    best_tab = (out.tables, out.strategies)
    if progress is not None:
        progress(len(seen), len(configs), best_t if best is not None else None)
    if best is None:
        raise no_plan_error(cluster, seen, statuses, time_limit_s, _binding(
            traced, cluster, layout, support, mapping, memo, statuses, even_stages))
    _price_alternatives(traced, cluster, global_batch_size, layout, support, mapping,
                        seen, even_stages, memo)
    status = solver_status(best_t, statuses, lower, len(configs), time_limit_s)
    return SearchResult(best, best_tab[0], best_tab[1], seen, time.perf_counter() - start,
                        status)


def _binding(traced, cluster, layout, support, mapping, memo, statuses, even_stages) -> str | None:
    """The stages in CP-SAT's infeasible core for the INFEASIBLE config whose mesh holds
    the fewest parameters per GPU (the most memory-frugal one), as text; None if none."""
    infeasible = [c for c, s in statuses.items() if s == "INFEASIBLE"]
    if not infeasible:
        return None
    cfg = min(infeasible, key=lambda c: (1 / (c.tp * c.pp), c.micro_batch_size))
    model = solve_config(traced, cluster, cfg, layout, support, mapping,
                         even_stages=even_stages, memo=memo, assume_memory=True).model
    stages = binding_stages(model)
    if not stages:
        return None
    rows = ", ".join(f"memory[stage {i}]" for i in stages)
    return (f"{rows} of tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} mbs={cfg.micro_batch_size} "
            f"{cfg.schedule}")


def _pruned(traced, cluster, cfg: Config, memo: dict, layout: Layout,
            support: RuntimeSupport | None, best_t: float) -> dict | None:
    """The ``seen`` entry of a config that need not be solved (the memory lower bound says
    it does not fit in device memory less the reserve, or a step-time bound of
    :func:`_bounds` says it cannot fit or cannot beat ``best_t`` seconds), else None."""
    mem_lb = memory_lower_bound_bytes(traced, cfg, zero_choices(layout, support, cfg.pp))
    usable = max_usable_bytes(p2p_bytes(traced, cfg), cluster, cfg)
    if mem_lb > usable:
        return {"layout": asdict(cfg), "step_time_s": None, "feasible": False,
                "min_memory_bytes": mem_lb,
                "reason": f"needs at least {mem_lb / 2**30:.1f} GiB per GPU > "
                          f"{max(usable, 0.0) / 2**30:.1f} GiB usable "
                          f"({cluster.device.memory_gib:.0f} GiB less the memory reserve)"}
    lb = _bounds(traced, cluster, cfg, memo, layout, support, best_t)
    if lb == float("inf"):
        return {"layout": asdict(cfg), "step_time_s": None, "feasible": False,
                "reason": "pipeline rank 0 does not fit memory with any layer count and "
                          "recompute (memory-time lower bound)"}
    if lb >= best_t:
        return {"layout": asdict(cfg), "step_time_s": None, "feasible": None,
                "reason": f"pruned: step-time lower bound {lb:.3f} s >= best {best_t:.3f} s"}
    return None


def _price_alternatives(traced, cluster, global_batch_size, layout, support, mapping, seen,
                        even_stages, memo: dict, count: int = 4,
                        time_limit_s: float = ALTERNATIVE_TIME_LIMIT_S) -> None:
    """Solve the best few configs that lost to the cutoff without it, so the report can
    show how much slower they are (the search itself never needed their optimum), each
    within ``time_limit_s`` of deterministic time: a plan CP-SAT did not prove optimal
    is marked "slower (not proven optimal: CP-SAT stopped at its time limit)"."""
    for entry in [s for s in seen if s["feasible"] is None and "CP-SAT" in s["reason"]][:count]:
        cfg = Config(**entry["layout"])
        decision, status, tables, strategies = solve_one(
            traced, cluster, cfg, layout, support, mapping, time_limit_s=time_limit_s,
            even_stages=even_stages, memo=memo)
        if decision is None:
            feasible, reason = unsolved(status, float("inf"))
            entry.update(feasible=feasible, reason=reason)
            continue
        pred = predict(traced, strategies, tables, cluster, decision,
                       global_batch_size=global_batch_size)
        entry.update(step_time_s=pred.step_time_s, feasible=True,
                     tflops_per_gpu=pred.tflops_per_gpu,
                     peak_memory_bytes=pred.peak_memory_bytes,
                     reason="slower" if status == "OPTIMAL" else
                     "slower (not proven optimal: CP-SAT stopped at its time limit)")
