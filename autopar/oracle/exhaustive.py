r"""An exhaustive check of the search: the optimum of the same plan space, found without CP-SAT.

:func:`exhaustive` visits every config of :func:`autopar.planner.search.candidate_configs` (no bound
pruning) and, per config, every plan the CP-SAT model of :mod:`autopar.planner.cpsat` admits: a TP
strategy per node of the pre section, the template layer and the post section (resharding
transitions offered by :func:`~autopar.planner.strategies.reshard_kinds`, replicated layer
boundaries, tied weights split alike), stage sizes within ``STAGE_SLACK`` of even (interleaved
1F1B: L/p layers per rank, p·v equal chunks), per stage the numbers of full and selective
recompute layers, and the ZeRO stage. Each plan is priced with predict's section sums and the
per-step arithmetic of :mod:`autopar.planner.costs.step` (as :func:`autopar.planner.costs.predict.predict`)
and must fit device memory less the reserve (:mod:`autopar.planner.costs.reserve`); the fastest
wins (ties: lower ZeRO stage, less recompute).

Three exact reductions keep this tractable; neither can lose the optimum.

* **TP assignments** (about 1.5e7 per GPT layer at t = 2) are enumerated by dynamic
  programming in graph order over the *live* tensors (producer strategy, "Megatron f
  already charged", placements already resharded to), propagating only transitions the
  producers allow. A section's plan enters the step time and memory only through the
  :data:`FIELDS` vector (:mod:`autopar.oracle.section_vectors`), both non-decreasing in
  every field once ``time_s`` is split into its backward part and the rest and the
  weight-gradient seconds a split backward defers are negated (``_key`` there), so per
  live state only Pareto-minimal vectors are kept.
* **Busy time** bounds the step from below: rank i runs m micro-batches of :math:`T_i`
  seconds, so a plan with :math:`m \max_i T_i` above the best so far is not priced (the
  order-priced schedules simulate their order per plan).
* **Recompute** changes only its own stage's time :math:`T_i` and memory (not its weight
  gradients), and the step time is non-decreasing in every :math:`T_i`; so per stage the feasible
  :math:`(r^{full}_i, r^{sel}_i)` of least :math:`T_i` is optimal (all pairs are tried).

``rounding="predict"`` checks memory with predict's exact bytes; ``rounding="solver"`` with
the integer KiB / 1024-parameter units of :meth:`autopar.planner.cpsat.ConfigModel.add_memory`
(rounded up per node, the loss bytes rounded down).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace


from autopar.graph.annotate import TracedModel
from autopar.graph.capture import trace_model
from autopar.oracle.section_vectors import (FIELDS, SectionOption, replicated_index,
                                            section_options, ties_agree)
from autopar.contract.plan import Alternative, Layout, Plan
from autopar.planner.costs.tables import Config, cost_tables
from autopar.planner.cpsat.terms import template_map
from autopar.planner.costs.decision import (Decision, InfeasibleError, plan_from_decision,
                                      stage_bounds_and_recompute, stage_splits)
from autopar.planner.costs.reserve import usable_bytes
from autopar.planner.search import candidate_configs, validate_layout, zero_choices
from autopar.planner.costs.step import (KIB, counts_tied_weight_once, head_rank, in_flight_times_v,
                                  model_state_bytes_by_kind, scaled_memory_limit,
                                  state_kib_times_d, step_time_s)
from autopar.planner.strategies import node_strategies, tied_groups
from autopar.contract.support import RUNTIME_SUPPORT, RuntimeSupport
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.techniques.recompute_modes import recomputed_by

__all__ = ["FIELDS", "SectionOption", "StagePlan", "ExhaustiveResult", "exhaustive",
           "exhaustive_search", "section_options", "stage_splits", "price", "replicated_index",
           "ties_agree", "decision_of", "config_options"]

@dataclass(frozen=True)
class StagePlan:
    """Layers, full and selective recompute counts of one pipeline stage."""

    layers: int
    full: int
    selective: int


@dataclass(frozen=True)
class _Rank:
    """What a rank's memory row takes from (config, rank, ZeRO stage) alone, computed once
    per rank rather than per recompute pair: the bytes it may use, the micro-batches in
    flight (whole-stage; times v rounded, for the solver's row), head-section copies held
    (0 off the head's rank: its loss tensors to B, ``heads``, the rest to W,
    ``head_inputs``) and model-state KiB per parameter unit times d."""

    usable: float
    inflight: float
    inflight_v: int
    heads: int
    head_inputs: int
    state_kib_d: int
    last: bool = False  # rank i holds the post section (head_rank)
    tied_once: bool = False  # counts_tied_weight_once(cfg)
    limit_kib_dv: int = 0  # scaled_memory_limit(usable, cfg)


def _rank(tables, cfg: Config, i: int, zero: int, cluster) -> _Rank:
    """The :class:`_Rank` of rank ``i`` of ``cfg`` under ZeRO stage ``zero``."""
    record, m, v = pipeline_schedule(cfg.schedule), cfg.num_micro_batches, cfg.virtual_stages
    head = i == head_rank(cfg)
    heads = record.head_in_flight(cfg.pp, m, v) if head else 0  # GPipe: m
    inputs = record.head_weight_inputs_in_flight(cfg.pp, m, v) if head else 0
    usable = usable_bytes(tables.p2p_bytes, cluster, cfg, i)
    return _Rank(usable, record.in_flight(cfg.pp, i, m, v), in_flight_times_v(cfg, i), heads,
                 inputs, state_kib_times_d(zero, cfg), head, counts_tied_weight_once(cfg),
                 scaled_memory_limit(usable, cfg))


def _stage(sections, tables, cfg: Config, i: int, sp: StagePlan, zero: int, rounding: str,
           cluster, rank: _Rank | None = None):
    """(seconds of one micro-batch, parameters, backward seconds (compute + TP comm: what
    bucketed DP reduction hides behind), memory bytes, fits in ``cluster``'s usable bytes
    with the loss temporaries) of rank ``i``; solver rounding: the CP-SAT row
    (:func:`~autopar.planner.costs.step.scaled_memory`). ``rank``: :func:`_rank`'s, if known."""
    k = rank or _rank(tables, cfg, i, zero, cluster)
    pre, lay, post = sections[0].fields, sections[1].fields, sections[2].fields
    n = sp.layers
    first, last = i == 0, k.last
    keep = n - sp.full - sp.selective
    t = n * lay["time_s"] + sp.full * lay["rec_s"] + sp.selective * lay["core_s"]
    t += first * pre["time_s"] + last * post["time_s"]
    bwd = n * lay["bwd_s"] + first * pre["bwd_s"] + last * post["bwd_s"]
    pkey, ukey = ("params_p1", "param_units_p1") if k.tied_once else ("params", "param_units")
    params = n * lay["params"] + first * pre["params"] + last * post[pkey]
    if rounding == "predict":  # interleaved: fractional in-flight micro-batches
        act = (keep * lay["act_bytes"] + sp.selective * lay["sel_act_bytes"]
               + sp.full * tables.full_ckpt_bytes + first * pre["act_bytes"])
        states = model_state_bytes_by_kind(params, zero, cfg)
        mem = sum(states.values()) + (k.inflight * act + lay["act_bytes"]
                                      + k.head_inputs * (post["act_bytes"] - post["loss_act_bytes"])
                                      + k.heads * post["loss_act_bytes"])
        return t, params, bwd, mem, mem + last * post["temp_bytes"] <= k.usable
    units = n * lay["param_units"] + first * pre["param_units"] + last * post[ukey]
    act = (keep * lay["act_kib"] + sp.selective * lay["sel_act_kib"]
           + sp.full * math.ceil(tables.full_ckpt_bytes / KIB) + first * pre["act_kib"])
    working = (lay["act_kib"] + k.head_inputs * (post["act_kib"] - post["loss_act_kib"])
               + k.heads * post["loss_act_kib"])
    v, d = cfg.virtual_stages, cfg.dp
    mem_dv = v * k.state_kib_d * units + d * (k.inflight_v * act + v * working)  # scaled_memory
    return (t, params, bwd, mem_dv / (d * v) * KIB,
            mem_dv + d * v * last * post["temp_kib"] <= k.limit_kib_dv)


def _wgrad(sections, cfg: Config, i: int, n: int) -> float:
    """Weight-gradient seconds of one micro-batch on rank ``i`` with ``n`` layers."""
    pre, lay, post = sections
    return n * lay["wgrad_s"] + (i == 0) * pre["wgrad_s"] + (i == head_rank(cfg)) * post["wgrad_s"]


def _forward(sections, cfg: Config, i: int, n: int) -> float:
    """Forward seconds (compute and TP communication) of one micro-batch on rank ``i``
    with ``n`` layers: each section's ``time_s`` less its ``bwd_s``."""
    pre, lay, post = sections
    return sum(k * (s["time_s"] - s["bwd_s"]) for k, s in (
        (n, lay), (i == 0, pre), (i == head_rank(cfg), post)))


def price(sections, tables, cluster, cfg: Config, stages: list[StagePlan], zero: int,
          rounding: str = "predict") -> tuple[float, list[float], bool]:
    """Predicted step time (seconds, as :func:`autopar.planner.costs.predict.predict`), memory
    bytes per stage and whether every stage fits, from the section vectors alone (no graph
    walk; the per-step arithmetic is :func:`autopar.planner.costs.step.step_time_s`)."""
    per = [_stage(sections, tables, cfg, i, sp, zero, rounding, cluster)
           for i, sp in enumerate(stages)]
    times, params, bwds, mems, fits = zip(*per)
    wgrad = [_wgrad(sections, cfg, i, sp.layers) for i, sp in enumerate(stages)]
    fwd = [_forward(sections, cfg, i, sp.layers) for i, sp in enumerate(stages)]
    return (step_time_s(times, params, bwds, tables, cluster, cfg, zero, wgrad_s=wgrad,
                        forward_s=fwd)[0],
            list(mems), all(fits))


def _best_stage(sections, tables, cfg, i, n, zero, modes, rounding, cluster, rank: _Rank):
    """(stage time, parameters, backward seconds, StagePlan, pairs tried) of the feasible
    (full, selective) recompute counts of least stage time; the first four None if none fits."""
    best, tried = (None, None, None, None), 0
    allowed = recomputed_by(modes)
    for rf in range(n + 1) if allowed["layer"] else (0,):
        for rs in range(n - rf + 1) if allowed["attention_core"] else (0,):
            if not allowed["nothing"] and rf + rs < n:
                continue
            sp = StagePlan(n, rf, rs)
            tried += 1
            t, pa, bwd, _, ok = _stage(sections, tables, cfg, i, sp, zero, rounding, cluster,
                                       rank)
            if ok and (best[0] is None or t < best[0]):
                best = (t, pa, bwd, sp)
    return (*best, tried)


def _best_for_config(traced, tables, cluster, cfg, options, zero_stages, modes, rounding):
    """((step time, sections, stage plans, zero stage) | None, plans covered) for ``cfg``;
    plans covered counts every (sections, ZeRO, split, per-stage recompute) combination."""
    groups = tied_groups(traced)
    splits = stage_splits(traced.num_layers, cfg.pp, cfg.virtual_stages)
    best, covered = None, 0
    ranks = {(i, z): _rank(tables, cfg, i, z, cluster) for i in range(cfg.pp) for z in zero_stages}
    for sections in itertools.product(*options):
        if not ties_agree(*sections, groups=groups):
            continue
        for zero, split in itertools.product(zero_stages, splits):
            stages = [_best_stage(sections, tables, cfg, i, n, zero, modes, rounding, cluster,
                                  ranks[i, zero]) for i, n in enumerate(split)]
            covered += math.prod(s[4] for s in stages)
            if any(s[0] is None for s in stages):
                continue
            times, params, bwds, plans, _ = zip(*stages)
            if best is not None and cfg.num_micro_batches * max(times) > best[0]:
                continue  # each rank is busy m·T_i: no price below it (order-priced: costly)
            wgrad = [_wgrad(sections, cfg, i, n) for i, n in enumerate(split)]
            fwd = [_forward(sections, cfg, i, n) for i, n in enumerate(split)]
            step = step_time_s(times, params, bwds, tables, cluster, cfg, zero, wgrad_s=wgrad,
                               forward_s=fwd)[0]
            if best is None or step < best[0] * (1 - 1e-12):
                best = (step, sections, list(plans), zero)
    return best, covered


@dataclass
class ExhaustiveResult:
    """The optimum: Decision, step time (s), its config's tables and strategies, per-config
    optima (``seen``), plans covered (:func:`_best_for_config`) and wall seconds."""

    decision: Decision | None
    step_time_s: float
    tables: object
    strategies: object
    seen: list[dict]
    plans_covered: int
    solve_time_s: float


def config_options(traced, strategies, tables, prune: bool = True):
    """(pre, layer, post) Pareto options of one config's TP assignments (each section given
    as names, the boundary node feeding it, and whether its output must be replicated)."""
    sections = ((traced.pre, None, True), (traced.layers[0], traced.pre[-1], True),
                (traced.post, traced.layers[-1][-1], False))
    return tuple(section_options(traced, strategies, tables, *s, prune) for s in sections)


def decision_of(traced, cfg, sections, stages: list[StagePlan], zero, step, elapsed) -> Decision:
    """The Decision of one priced plan: (pre, layer, post) ``sections`` options on ``cfg``,
    per-rank ``stages``, ZeRO stage, step time and wall seconds (as the CP-SAT readback)."""
    chosen = {**sections[0].choice, **sections[1].choice, **sections[2].choice}
    bounds, recompute = stage_bounds_and_recompute(
        [sp.layers for sp in stages], [(sp.full, sp.selective) for sp in stages],
        cfg.virtual_stages, schedule=cfg.schedule)
    return Decision(cfg, {n: chosen[t] for n, t in template_map(traced).items()}, bounds, recompute, zero,
                    step, elapsed)


def exhaustive_search(traced: TracedModel, cluster, global_batch_size: int,
                      layout: Layout | None = None, support: RuntimeSupport = RUNTIME_SUPPORT,
                      rounding: str = "predict") -> ExhaustiveResult:
    """The fastest plan over every config and every plan of each (see the module docstring).
    Raises ValueError for an unknown ``rounding`` or a layout :func:`validate_layout` rejects."""
    if rounding not in ("predict", "solver"):
        raise ValueError(f"rounding must be 'predict' or 'solver', got {rounding!r}")
    start, layout = time.perf_counter(), layout or Layout()
    validate_layout(traced, cluster, layout, global_batch_size)
    modes = (layout.recompute,) if layout.recompute else \
        support.recompute
    cache, best, seen, priced = {}, None, [], 0
    for cfg in candidate_configs(traced, cluster, global_batch_size, layout, support):
        strategies = node_strategies(traced, cfg.tp, cfg.sequence_parallel, cfg.ep)
        tables = cost_tables(traced, strategies, cluster, cfg)
        key = (cfg.tp, cfg.micro_batch_size, cfg.dtype, cfg.sequence_parallel, cfg.ep)  # costs' inputs
        if key not in cache:
            cache[key] = config_options(traced, strategies, tables)
        zeros = zero_choices(layout, support, cfg)
        allowed = pipeline_schedule(cfg.schedule).recompute_modes(modes)
        found, n = _best_for_config(traced, tables, cluster, cfg, cache[key], zeros, allowed,
                                    rounding)
        priced += n
        seen.append({"layout": cfg, "step_time_s": found[0] if found else None})
        if found and (best is None or found[0] < best[0][0] * (1 - 1e-12)):
            best = (found, cfg, tables, strategies)
    elapsed = time.perf_counter() - start
    if best is None:
        return ExhaustiveResult(None, math.inf, None, None, seen, priced, elapsed)
    (step, sections, stages, z), cfg, tables, strategies = best
    return ExhaustiveResult(decision_of(traced, cfg, sections, stages, z, step, elapsed), step,
                            tables, strategies, seen, priced, elapsed)


def exhaustive(model, cluster, *, global_batch_size: int, seq_len: int, layout: Layout | None = None,
               support: RuntimeSupport = RUNTIME_SUPPORT, rounding: str = "predict",
               model_name: str = "model") -> Plan:
    """The optimal Plan of the search space of :func:`autopar.plan`, by exhaustion; its
    ``predicted`` comes from :func:`autopar.planner.costs.predict.predict`. Raises InfeasibleError when
    no plan fits in memory."""
    traced = trace_model(model, seq_len, name=model_name)
    res = exhaustive_search(traced, cluster, global_batch_size, layout, support, rounding)
    if res.decision is None:
        raise InfeasibleError(f"no plan of the search space fits in {cluster.device.memory_gib} "
                              f"GiB per GPU (exhaustive check, {res.plans_covered} plans covered)")
    seen = [Alternative(layout=vars(s["layout"]), step_time_s=s["step_time_s"],
                        feasible=s["step_time_s"] is not None) for s in res.seen]
    out = plan_from_decision(traced, model, cluster, res.decision, res.tables, res.strategies,
                             global_batch_size=global_batch_size, seq_len=seq_len,
                             model_name=model_name, seen=seen)
    return replace(out, solve_wall_s=res.solve_time_s)
