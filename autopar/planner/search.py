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
from autopar.plan import RECOMPUTE_MODES, ZERO_STAGES, Layout
from autopar.planner.bounds import (compute_bound_s, memory_lower_bound_bytes, memory_time_bound_s,
                                    min_layer_compute_s)
from autopar.planner.cost_tables import Config, cost_tables
from autopar.planner.cpsat import ConfigModel, min_layer_time_s, template_map
from autopar.planner.decision import Decision, InfeasibleError
from autopar.planner.predict import predict
from autopar.planner.strategies import node_strategies
from autopar.support import RUNTIME_SUPPORT, RuntimeSupport, divisors, pipeline_problem

__all__ = ["candidate_configs", "search", "solve_one", "strategies_for", "validate_layout",
           "SearchResult"]

MAX_MICRO_BATCH_SIZE = 8
# The CP-SAT objective rounds coefficients to integer units (parameters up to 1024, times
# to ~1e-4 of a layer), so it may overshoot the prediction slightly; a config is only cut
# off when it cannot beat the incumbent by more than this margin, then predict decides.
CUTOFF_SLACK = 0.01
SOLVE_BATCH = 2  # configs solved at once, each with the cutoff from before the batch (fixed,
# not the core count, so the search path and its result are the same on every machine)
ALTERNATIVE_TIME_LIMIT_S = 0.25  # CP-SAT deterministic time per runner-up priced for the report


def _heads(traced: TracedModel) -> int | None:
    """Attention heads a of the traced model (dim 1 of its attention's output), None if it
    has no attention node."""
    for n in traced.layers[0] if traced.layers else []:
        info = traced.nodes[n]
        if info.kind == "sdpa":
            return info.shape[1]
    return None


def validate_layout(traced: TracedModel, cluster, layout: Layout, global_batch_size: int) -> None:
    """:func:`autopar.support.validate_layout` for ``traced`` on ``cluster`` (ValueError
    saying what to change)."""
    support_rules.validate_layout(layout, num_gpus=cluster.num_gpus,
                                  gpus_per_node=cluster.gpus_per_node, heads=_heads(traced),
                                  num_layers=traced.num_layers,
                                  global_batch_size=global_batch_size)


def candidate_configs(traced: TracedModel, cluster, global_batch_size: int, layout: Layout,
                      support: RuntimeSupport | None = RUNTIME_SUPPORT) -> list[Config]:
    """All (tp, pp, dp, mbs, schedule, v) consistent with ``layout`` and the runtime.

    Schedules: the layout's, else 1F1B and (when the runtime executes it) interleaved 1F1B.
    Interleaved configs take each v >= 2 the runtime declares (or the layout's v); every
    other schedule gets v = 1; a (schedule, p, m, v) is kept when
    :func:`~autopar.support.pipeline_problem` accepts it (1F1B: m >= p; interleaved:
    pp > 1, L % (pp·v) == 0, m % pp == 0). ``support`` None (evaluating a hand layout): the
    layout's schedule and v, checked by the same rule.
    """
    n, heads, L = cluster.num_gpus, _heads(traced), traced.num_layers
    interleave = support is not None and "interleaved_1f1b" in support.schedules
    schedules = [layout.schedule] if layout.schedule else \
        (["interleaved_1f1b"] if (layout.virtual_stages or 1) > 1 else
         ["1f1b"] + ["interleaved_1f1b"] * interleave)
    out = []
    for tp in divisors(n):
        if tp > cluster.gpus_per_node or (heads and heads % tp) or layout.tp not in (None, tp):
            continue
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp > L or layout.pp not in (None, pp) or layout.dp not in (None, dp):
                continue
            if global_batch_size % dp:
                continue
            per_replica = global_batch_size // dp
            for mbs in divisors(per_replica):
                if layout.micro_batch_size not in (None, mbs) or (
                        layout.micro_batch_size is None and mbs > MAX_MICRO_BATCH_SIZE):
                    continue
                m = per_replica // mbs
                for sched in schedules:
                    if support and sched not in support.schedules:
                        continue
                    for v in _virtual_stages(sched, layout, support, L, pp, m):
                        if pipeline_problem(sched, pp, m, L, v):
                            continue
                        out.append(Config(tp, pp, dp, mbs, m, sched, v,
                                          layout.dtype or cluster.dtype, cluster.attention,
                                          bool(layout.sequence_parallel) and tp > 1))
    return out


def _virtual_stages(schedule: str, layout: Layout, support: RuntimeSupport | None, L: int,
                    pp: int, m: int) -> tuple[int, ...]:
    """The v to try for one (schedule, pp, m): see :func:`candidate_configs`."""
    if schedule != "interleaved_1f1b":
        return (1,) if (layout.virtual_stages or 1) == 1 else ()
    if layout.virtual_stages is not None or support is None:
        return (layout.virtual_stages or 2,)
    return support.virtual_stages_for(schedule, L, pp, m)


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
    return max(bound, memory_time_bound_s(traced, tables, cfg, layer_s, cluster.device.memory_bytes,
                                          zero_choices(layout, support, cfg.pp), modes))


@dataclass
class SearchResult:
    """The best decision, its tables, and every config the search looked at."""

    decision: Decision | None
    tables: object
    strategies: object
    seen: list[dict]
    solve_time_s: float


def zero_choices(layout: Layout, support: RuntimeSupport | None, pp: int) -> tuple[int, ...]:
    """ZeRO stages to consider: the layout's if pinned, else what the runtime executes with
    ``pp`` stages (support None: every stage the cost model prices, for evaluation)."""
    if layout.zero_stage is not None:
        return (layout.zero_stage,)
    return support.zero_stages_for(pp) if support else ZERO_STAGES


def solve_one(traced, cluster, cfg: Config, layout: Layout, support: RuntimeSupport | None,
              mapping, time_limit_s: float = 1.0, even_stages: bool = False,
              cutoff_s: float | None = None, memo: dict | None = None):
    """Solve one Config with CP-SAT (:class:`~autopar.planner.cpsat.ConfigModel`) within
    ``time_limit_s`` seconds of deterministic time, only for plans faster than ``cutoff_s``
    seconds when given; ``mapping``: :func:`~autopar.planner.cpsat_terms.template_map`;
    ``memo``: strategies and cost tables shared by the configs of one search
    (:func:`strategies_for`, :func:`~autopar.planner.cost_tables.cost_tables`).
    Returns (Decision | None, CP-SAT status name, tables, strategies): None unless the
    status is OPTIMAL or FEASIBLE (FEASIBLE: stopped at the limit, not proven optimal)."""
    from ortools.sat.python import cp_model

    memo = {} if memo is None else memo
    strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, memo)
    tables = cost_tables(traced, strategies, cluster, cfg, memo)
    zero = zero_choices(layout, support, cfg.pp)
    modes = support.recompute if support else RECOMPUTE_MODES
    model = ConfigModel(traced, strategies, tables, cluster, zero_stages=zero,
                        recompute_modes=modes, fixed_recompute=layout.recompute,
                        even_stages=even_stages)
    model.build()
    if cutoff_s is not None and cutoff_s < float("inf"):
        model.add_cutoff(cutoff_s)
    status, solver = model.solve(time_limit_s)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, name, tables, strategies
    return model.decision(solver, mapping), name, tables, strategies


def search(traced: TracedModel, cluster, global_batch_size: int, layout: Layout,
           support: RuntimeSupport | None = RUNTIME_SUPPORT,
           even_stages: bool = False,
           progress: Callable[[int, int, float | None], None] | None = None) -> SearchResult:
    """Branch and bound over the configs of :func:`candidate_configs` for ``traced`` on
    ``cluster`` with B = ``global_batch_size``: configs in order of a compute lower bound
    (seconds), each pruned by that bound or the memory lower bound (bytes) or solved by
    CP-SAT with the best step time so far as cutoff, then priced by ``predict``; configs
    that reach CP-SAT are solved :data:`SOLVE_BATCH` at a time on threads, each batch with
    the cutoff from before it, and read back in order (deterministic).
    ``even_stages``: layers split evenly as Megatron does (hand layouts).

    Raises ValueError (:func:`validate_layout`, or no config fits the layout) and
    InfeasibleError when nothing fits, saying per mesh shape what the search found.

    progress: called as ``progress(visited, total, best_step_time_s)`` before each of the
        ``total`` configs (mesh shape and micro-batch size) is solved or pruned, and once
        more with ``visited == total`` at the end; best_step_time_s is the best predicted
        step time found so far in seconds, None while nothing fits. It only observes: the
        result does not depend on it.
    """
    start = time.perf_counter()
    validate_layout(traced, cluster, layout, global_batch_size)
    mapping = template_map(traced)
    configs = candidate_configs(traced, cluster, global_batch_size, layout, support)
    if not configs:
        raise ValueError(f"no (tp, pp, dp, micro_batch_size) fits {cluster.num_gpus} GPUs, "
                         f"global_batch_size={global_batch_size} and layout {layout}; relax "
                         "the fixed fields or change the batch size")
    memo: dict = {}
    bound = {c: _bounds(traced, cluster, c, memo, layout, support, 0.0) for c in configs}
    configs.sort(key=bound.get)
    best, best_t, best_tab, seen, statuses = None, float("inf"), None, [], {}
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
                        solve_one, traced, cluster, cfg, layout, support, mapping,
                        even_stages=even_stages, cutoff_s=cutoff * (1 + CUTOFF_SLACK), memo=memo)))
                else:
                    seen.append(pruned)
            for cfg, future in batch:  # in config order: the result never depends on timing
                decision, status, tables, strategies = future.result()
                statuses[cfg] = status
                if decision is None:
                    feasible, reason = _unsolved(status, cutoff)
                    seen.append({"layout": asdict(cfg), "step_time_s": None,
                                 "feasible": feasible, "reason": reason})
                    continue
                pred = predict(traced, strategies, tables, cluster, decision,
                               global_batch_size=global_batch_size)
                seen.append({"layout": asdict(cfg), "step_time_s": pred.step_time_s,
                             "feasible": True, "tflops_per_gpu": pred.tflops_per_gpu,
                             "peak_memory_bytes": pred.peak_memory_bytes, "reason": ""})
                if pred.step_time_s < best_t:
                    best, best_t, best_tab = decision, pred.step_time_s, (tables, strategies)
    if progress is not None:
        progress(len(seen), len(configs), best_t if best is not None else None)
    if best is not None:
        _price_alternatives(traced, cluster, global_batch_size, layout, support, mapping,
                            seen, even_stages, memo)
    elapsed = time.perf_counter() - start
    if best is None:
        raise InfeasibleError(_infeasible_message(cluster, seen, statuses))
    return SearchResult(best, best_tab[0], best_tab[1], seen, elapsed)


def _pruned(traced, cluster, cfg: Config, memo: dict, layout: Layout,
            support: RuntimeSupport | None, best_t: float) -> dict | None:
    """The ``seen`` entry of a config that need not be solved (the memory lower bound says
    it does not fit, or a step-time bound of :func:`_bounds` says it cannot fit or cannot
    beat ``best_t`` seconds), else None."""
    mem_lb = memory_lower_bound_bytes(traced, cfg, zero_choices(layout, support, cfg.pp))
    if mem_lb > cluster.device.memory_bytes:
        return {"layout": asdict(cfg), "step_time_s": None, "feasible": False,
                "min_memory_bytes": mem_lb,
                "reason": f"needs at least {mem_lb / 2**30:.1f} GiB per GPU > "
                          f"{cluster.device.memory_gib:.0f} GiB"}
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
            feasible, reason = _unsolved(status, float("inf"))
            entry.update(feasible=feasible, reason=reason)
            continue
        pred = predict(traced, strategies, tables, cluster, decision,
                       global_batch_size=global_batch_size)
        entry.update(step_time_s=pred.step_time_s, feasible=True,
                     tflops_per_gpu=pred.tflops_per_gpu,
                     peak_memory_bytes=pred.peak_memory_bytes,
                     reason="slower" if status == "OPTIMAL" else
                     "slower (not proven optimal: CP-SAT stopped at its time limit)")


def _unsolved(status: str, best_t: float) -> tuple[bool | None, str]:
    """(feasible, reason) of a config CP-SAT returned no plan for: with a cutoff
    (``best_t`` finite) INFEASIBLE means it cannot beat the best plan; without one only the
    memory rows can fail (:mod:`autopar.planner.cpsat`). Any other status means CP-SAT
    stopped at its time limit: not proven infeasible (feasible None), never "does not fit"."""
    if status == "INFEASIBLE" and best_t < float("inf"):
        return None, (f"cannot beat the best plan ({best_t:.3f} s) within memory "
                      f"(CP-SAT {status})")
    if status == "INFEASIBLE":
        return False, ("no plan fits device memory (CP-SAT INFEASIBLE: memory[stage i] "
                       "fails on some stage for every choice)")
    return None, (f"CP-SAT stopped at its time limit without a plan (status {status}): "
                  "not proven infeasible")


def _infeasible_message(cluster, seen: list[dict], statuses: dict) -> str:
    """Why no plan was found, per mesh shape: pruned by the memory lower bound, INFEASIBLE
    for CP-SAT, or stopped at CP-SAT's time limit (then the message says so)."""
    bounds = [s["min_memory_bytes"] for s in seen if "min_memory_bytes" in s]
    need = (f"the most memory-frugal mesh shape needs at least {min(bounds) / 2**30:.2f} GiB per "
            "GPU" if bounds else "every mesh shape exceeds it once activations are counted")
    found = []
    if bounds:
        found.append(f"{len(bounds)} pruned by the memory lower bound (model states and "
                     f"full-recompute checkpoints: {min(bounds) / 2**30:.2f} GiB and up vs "
                     f"{cluster.device.memory_gib:.1f} GiB)")
    rank0 = sum(1 for s in seen if "memory-time lower bound" in s["reason"])
    if rank0:
        found.append(f"{rank0} where pipeline rank 0 cannot fit its layers with any "
                     "recompute (memory-time lower bound of autopar.planner.bounds)")
    infeasible = sum(1 for s in statuses.values() if s == "INFEASIBLE")
    if infeasible:
        found.append(f"{infeasible} INFEASIBLE for CP-SAT (memory[stage i] fails on some "
                     "pipeline stage for every strategy, split, recompute and ZeRO choice)")
    stopped = len(statuses) - infeasible
    if stopped:
        found.append(f"{stopped} stopped at CP-SAT's time limit without a plan (not proven "
                     "infeasible: a longer solve may find one)")
    return (f"no plan fits in {cluster.device.memory_gib:.1f} GiB per GPU "
            f"({cluster.device.name}, {cluster.num_gpus} GPUs): {need}. Of the {len(seen)} "
            f"mesh shapes: {'; '.join(found)}. Use more GPUs, GPUs with more memory, a "
            "smaller global batch or micro-batch, or allow ZeRO / recompute")
