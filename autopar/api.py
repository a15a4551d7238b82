"""The planning entry points: ``plan`` (search for the fastest layout), ``evaluate`` (price
a hand-written layout as Megatron-LM runs it, no search), ``evaluate_plan`` (re-price a
saved plan's decisions) and ``what_if_plans`` (re-plan on changed inputs for the report).

Thin: tracing (:mod:`autopar.graph`), the search (:mod:`autopar.planner.search`), the hand
layout's decision (:mod:`autopar.planner.hand_layout`) and Decision ↔ Plan
(:mod:`autopar.planner.costs.decision`) do the work.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable

import torch

from cost_models.hardware import Cluster

from autopar.graph.annotate import TracedModel
from autopar.contract.plan import Layout, Plan, SolverStatus
from autopar.contract.plan_check import check_plan
from autopar.planner.costs.decision import InfeasibleError, decision_from_plan, plan_from_decision
from autopar.planner.hand_layout import check_fits_memory, complete_hand_layout, hand_decision
from autopar.planner.plan_fit import check_plan_fits_model, check_seq_len
from autopar.planner.costs.predict import predict
from autopar.planner.strategies.replicated import replicated_ops
from autopar.planner.search.outcome import SolverTimeLimitError
from autopar.targets import target_support
from autopar.contract.support import check_positive_ints
from autopar.planner.search import DEFAULT_TIME_LIMIT_S, SearchResult, search
from autopar.graph.context_parallel import context_parallel_trace, folded_layout
from autopar.techniques.context_parallel import cp_degrees, cp_problem

__all__ = ["plan", "evaluate", "evaluate_plan", "what_if_plans", "plan_from_search",
           "check_problem"]


def plan_from_search(traced: TracedModel, model, cluster, result: SearchResult, *,
                     global_batch_size: int, seq_len: int, model_name: str) -> Plan:
    """The Plan of the search's best decision (:func:`~autopar.planner.costs.decision.plan_from_decision`
    with the search's tables, strategies and per-config records), with what the search
    proved (``solver``) and its wall time (``solve_wall_s``, not saved)."""
    out = plan_from_decision(traced, model, cluster, result.decision, result.tables,
                             result.strategies, global_batch_size=global_batch_size,
                             seq_len=seq_len, model_name=model_name, seen=result.seen)
    return replace(out, solver=result.solver, solve_wall_s=result.solve_time_s)


def check_problem(model, cluster, *, global_batch_size, seq_len, layout=None,
                  time_limit_s=DEFAULT_TIME_LIMIT_S) -> tuple[Cluster, Layout]:
    """The inputs of :func:`plan` / :func:`evaluate` checked at the door, before tracing:
    returns (cluster, layout), a preset name turned into its Cluster (one node) and None
    into ``Layout()``. Raises TypeError (a model that is not an nn.Module, a cluster that
    is neither a Cluster nor a preset name, a layout that is not a Layout) and ValueError
    (global_batch_size or seq_len not a positive int, seq_len beyond the model's maximum
    positions, a time limit that is not a positive number, an unknown preset)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(cluster, str):
        cluster = Cluster.from_name(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be an autopar.Cluster or a preset name (e.g. "
                        f"'local-cpu', 'dgx-a100'), got {type(cluster).__name__}; build one "
                        "with autopar.Cluster.from_name(name, nodes) or Cluster.local_cpu(n)")
    layout = Layout() if layout is None else layout
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be an autopar.Layout, got {type(layout).__name__}; "
                        "e.g. autopar.Layout(tp=2)")
    check_positive_ints(global_batch_size=global_batch_size, seq_len=seq_len)
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) \
            or not math.isfinite(time_limit_s) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be a positive number of seconds, got "
                         f"{time_limit_s!r}")
    check_seq_len(model, seq_len)
    problem = cp_problem(layout.cp or 1, seq_len)
    if problem:
        raise ValueError(problem)
    return cluster, layout


def plan(model: torch.nn.Module, cluster, *, global_batch_size: int, seq_len: int,
         layout: Layout | None = None, model_name: str = "model",
         progress: Callable[[int, int, float | None], None] | None = None,
         time_limit_s: float = DEFAULT_TIME_LIMIT_S, target: str = "autopar") -> Plan:
    """Find the fastest executable plan for training ``model`` on ``cluster``.

    model: a module with ``forward(idx (b, s)) -> logits (b, s, V)`` (or ``(logits, loss)``),
        ideally on the meta device. cluster: a :class:`Cluster` or a preset name
        ("local-cpu", "dgx-a100" ...: one node). layout: fields to pin (None = free); a pin
        the runtime cannot execute is refused (:func:`autopar.contract.support.check_pins`).
    progress: optional ``progress(visited, total, best_step_time_s)`` called as the search
        visits its configs (see :func:`autopar.planner.search.search`), e.g. to draw a progress bar.
    time_limit_s: CP-SAT's deterministic time per config; the plan's ``solver`` says
        whether the search proved it optimal (``plan.solver.status``).
    target: the runner the plan is for, "autopar" (this runtime), "megatron", "torchtitan"
        or "deepspeed": the search stays inside what that runner executes
        (:data:`autopar.targets.TARGETS`), so the plan is the best it can run.
    Raises TypeError / ValueError (:func:`check_problem`; degrees inconsistent with the
    cluster, heads not divisible by tp, a pin outside the runtime's space, no config left
    by the pins: each names the rule), TraceError (untraceable model), InfeasibleError
    (proven: nothing fits in memory; names the binding stage), SolverTimeLimitError (CP-SAT
    stopped at its time limit with no plan: raise ``time_limit_s``).
    """
    cluster, layout = check_problem(model, cluster, global_batch_size=global_batch_size,
                                    seq_len=seq_len, layout=layout, time_limit_s=time_limit_s)
    support = target_support(target)  # an unknown target fails before tracing
    if layout.cp not in (None, 1) and not support.context_parallel:
        raise ValueError(f"cp={layout.cp}: the {support.name} target runs no context "
                         "parallelism in autopar's plans; use cp=1 or --target autopar")
    degrees = cp_degrees(seq_len, cluster.num_gpus,
                         layout.cp if layout.cp is not None or support.context_parallel else 1)
    plans, failures = [], []
    for cp in degrees:  # one search per CP degree, each on the trace at s/c (module docstring)
        try:
            traced = context_parallel_trace(model, seq_len, cp, name=model_name,
                                            dtype=layout.dtype or cluster.dtype)
            result = search(traced, cluster, global_batch_size * cp, folded_layout(layout, cp),
                            support, progress=progress, time_limit_s=time_limit_s)
        except (InfeasibleError, SolverTimeLimitError, ValueError) as exc:
            if len(degrees) == 1:
                raise
            failures.append(exc)
            continue
        plans.append(plan_from_search(traced, model, cluster, result,
                                      global_batch_size=global_batch_size, seq_len=seq_len,
                                      model_name=model_name))
    if not plans:
        raise failures[0]  # cp = 1's: what stops the plain layouts
    return min(plans, key=lambda p: p.predicted.step_time_s)


def evaluate(model: torch.nn.Module, cluster, layout: Layout, *, global_batch_size: int,
             seq_len: int, model_name: str = "model",
             time_limit_s: float = DEFAULT_TIME_LIMIT_S,
             stage_layers: list[list[int]] | None = None,
             recompute: list[str] | None = None, check_memory: bool = True) -> Plan:
    """Price a hand-written layout (tp, pp, dp, micro_batch_size fixed) as Megatron-LM runs
    it, with the same cost model as :func:`plan` and no search: Megatron's TP placements
    (column-parallel QKV and MLP-in, row-parallel attention-out and MLP-out,
    vocabulary-parallel embedding; sequence parallelism as the layout says, default off),
    layers split evenly over the stages (the embedding on the first, the head on the last),
    the layout's recompute on every layer (unset: "none"), ZeRO stage (unset: 0), schedule
    (unset: "1f1b", interleaved when v > 1) and v
    (:mod:`autopar.planner.hand_layout`). The plan's ``solver.status`` is "EVALUATED";
    ``time_limit_s`` is checked and otherwise unused (nothing is solved).
    ``stage_layers`` (per model chunk [first, last) layers, as ``Plan.stage_layers``) and
    ``recompute`` (one mode per layer) replace the even split and the uniform mode, e.g.
    for Megatron-LM's ``--pipeline-model-parallel-layout`` and ``--recompute-method block``
    (:func:`autopar.frameworks.read_megatron_args`).
    ``check_memory=False`` returns the plan of a layout that does not fit the device under
    the memory model (its ``predicted.memory_margin_bytes`` then negative), to compare the
    time of a run published on hardware where the memory model disagrees with it.
    Raises TypeError / ValueError (:func:`check_problem`; an incomplete layout, degrees that
    do not fit the model, cluster or batch, stages or modes that do not fit the layout) and
    InfeasibleError naming the pipeline stage that does not fit in memory and its bytes
    (unless ``check_memory`` is False).
    """
    cluster, layout = check_problem(model, cluster, global_batch_size=global_batch_size,
                                    seq_len=seq_len, layout=layout, time_limit_s=time_limit_s)
    start = time.perf_counter()
    layout = complete_hand_layout(layout)
    cp = layout.cp or 1
    traced = context_parallel_trace(model, seq_len, cp, name=model_name,
                                    dtype=layout.dtype or cluster.dtype)
    decision, tables, strategies = hand_decision(traced, cluster, folded_layout(layout, cp),
                                                 global_batch_size * cp, stage_layers, recompute)
    out = plan_from_decision(traced, model, cluster, decision, tables, strategies,
                             global_batch_size=global_batch_size, seq_len=seq_len,
                             model_name=model_name)
    if check_memory:
        check_fits_memory(out.predicted, cluster, layout)
    return replace(out, solver=SolverStatus("EVALUATED", 0.0, 0.0, 1, 0),
                   solve_wall_s=time.perf_counter() - start)


def evaluate_plan(model: torch.nn.Module, cluster, plan: Plan) -> Plan:
    """Re-price ``plan``'s exact decisions (placements, stages, recompute, ZeRO) on
    ``cluster`` with the cost model, without solving: e.g. after editing placements by
    hand, or to price a saved plan on other hardware. Returns the plan with a new
    ``predicted`` and ``replicated_ops`` (the ops its placements leave whole). Raises
    :class:`~autopar.contract.plan_check.PlanError` (a ValueError) when the plan is not valid or
    does not fit this model (:func:`~autopar.planner.plan_fit.check_plan_fits_model`:
    e.g. a placement that does not exist for this model at its tp).
    """
    cluster, _ = check_problem(model, cluster, global_batch_size=plan.global_batch_size,
                               seq_len=plan.seq_len)
    check_plan(plan)
    traced = check_plan_fits_model(plan, model)
    decision, tables, strategies = decision_from_plan(traced, cluster, plan)
    pred = predict(traced, strategies, tables, cluster, decision,
                   global_batch_size=plan.global_batch_size * plan.cp)  # c·B rows of s/c
    return replace(plan, predicted=pred, replicated_ops=replicated_ops(
        traced, strategies, plan.placements, plan.tp, plan.sequence_parallel))


def what_if_plans(model: torch.nn.Module, cluster, chosen: Plan, *, layout: Layout | None = None,
                  progress: Callable[[str], Callable | None] | None = None,
                  target: str = "autopar") -> dict[str, Plan | str]:
    """Re-plan ``model`` for three changed inputs, for the report's "What if" section
    (:func:`autopar.report.whatif.what_if_markdown`): twice the nodes, twice the global
    batch and, on an A100 cluster, DGX H100 nodes of the same count. Three more searches,
    each about as long as the one that found ``chosen`` (seconds to a minute for big models).

    layout: the fields the user pinned, kept pinned in every what-if (a pin that no longer
        fits, e.g. dp with twice the nodes, makes that what-if a "no plan: ..." string).
    progress: ``progress(label)`` returns the :func:`plan` progress callback for the
        what-if named ``label`` (or None for no display).
    target: the runner ``chosen`` was planned for (:func:`plan`'s ``target``), kept.
    Returns label -> Plan, or the reason there is none (InfeasibleError or ValueError text).
    """
    cases = {"twice the nodes": (replace(cluster, nodes=2 * cluster.nodes),
                                 chosen.global_batch_size),
             "twice the global batch": (cluster, 2 * chosen.global_batch_size)}
    if "A100" in cluster.device.name:
        h100 = replace(Cluster.dgx_h100(nodes=cluster.nodes),  # the user's headroom kept
                       memory_headroom_gib=cluster.memory_headroom_gib)
        cases["H100 nodes instead of A100"] = (h100, chosen.global_batch_size)
    out: dict[str, Plan | str] = {}
    for label, (new_cluster, batch) in cases.items():
        try:
            out[label] = plan(model, new_cluster, global_batch_size=batch,
                              seq_len=chosen.seq_len, layout=layout, model_name=chosen.model,
                              progress=progress(f"what if {label}") if progress else None,
                              target=target)
        except (InfeasibleError, SolverTimeLimitError, ValueError) as exc:
            out[label] = f"no plan: {exc}"
    return out
