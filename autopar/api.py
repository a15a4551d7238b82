"""The planning entry points: ``plan`` (search for the fastest layout), ``evaluate`` (price
a hand-written layout), ``evaluate_plan`` (re-price a saved plan's decisions) and
``what_if_plans`` (re-plan on changed inputs for the report).

Thin: tracing (:mod:`autopar.graph`), the search (:mod:`autopar.planner.search`) and
Decision ↔ Plan (:mod:`autopar.planner.decision`) do the work.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from cost_models.hardware import Cluster

from autopar.graph.annotate import TracedModel
from autopar.plan import Layout, Plan
from autopar.planner.decision import InfeasibleError, decision_from_plan, plan_from_decision
from autopar.planner.predict import predict
from autopar.planner.replicated import replicated_ops
from autopar.support import RUNTIME_SUPPORT
from autopar.planner.search import SearchResult, search
from autopar.graph.capture import trace_model

__all__ = ["plan", "evaluate", "evaluate_plan", "what_if_plans", "plan_from_search"]


def plan_from_search(traced: TracedModel, model, cluster, result: SearchResult, *,
                     global_batch_size: int, seq_len: int, model_name: str) -> Plan:
    """The Plan of the search's best decision (:func:`~autopar.planner.decision.plan_from_decision`
    with the search's tables, strategies, per-config records and solve time)."""
    return plan_from_decision(traced, model, cluster, result.decision, result.tables,
                              result.strategies, global_batch_size=global_batch_size,
                              seq_len=seq_len, model_name=model_name, seen=result.seen,
                              solve_time_s=result.solve_time_s)


def plan(model: torch.nn.Module, cluster, *, global_batch_size: int, seq_len: int,
         layout: Layout | None = None, model_name: str = "model",
         progress: Callable[[int, int, float | None], None] | None = None) -> Plan:
    """Find the fastest executable plan for training ``model`` on ``cluster``.

    model: a module with ``forward(idx (b, s)) -> logits (b, s, V)`` (or ``(logits, loss)``),
        ideally on the meta device. layout: fields to pin (None = free).
    progress: optional ``progress(visited, total, best_step_time_s)`` called as the search
        visits its configs (see :func:`autopar.planner.search.search`), e.g. to draw a progress bar.
    Raises TraceError (untraceable model), InfeasibleError (nothing fits in memory),
    ValueError (degrees inconsistent with the cluster, heads not divisible by tp, ...).
    """
    layout = layout or Layout()
    traced = trace_model(model, seq_len, name=model_name, dtype=layout.dtype or cluster.dtype)
    result = search(traced, cluster, global_batch_size, layout, RUNTIME_SUPPORT,
                    progress=progress)
    return plan_from_search(traced, model, cluster, result, global_batch_size=global_batch_size,
                            seq_len=seq_len, model_name=model_name)


def evaluate(model: torch.nn.Module, cluster, layout: Layout, *, global_batch_size: int,
             seq_len: int, model_name: str = "model") -> Plan:
    """Price a hand-written layout (tp, pp, dp, micro_batch_size fixed) with the same cost
    model. Layers are split evenly over stages as Megatron does; unset recompute means
    "none", unset zero_stage 0, unset schedule "1f1b"; TP placements are Megatron's
    (the solver's optimum for the fixed degrees). Raises ValueError for an incomplete
    layout and InfeasibleError when it does not fit in memory.
    """
    if not layout.is_complete():
        raise ValueError("evaluate needs tp, pp, dp and micro_batch_size; use autopar.plan "
                         f"to choose the rest (got {layout})")
    layout = replace(layout, recompute=layout.recompute or "none",
                     zero_stage=layout.zero_stage if layout.zero_stage is not None else 0,
                     schedule=layout.schedule or ("interleaved_1f1b" if (layout.virtual_stages or 1) > 1 else "1f1b"))
    traced = trace_model(model, seq_len, name=model_name, dtype=layout.dtype or cluster.dtype)
    result = search(traced, cluster, global_batch_size, layout, support=None, even_stages=True)
    return plan_from_search(traced, model, cluster, result, global_batch_size=global_batch_size,
                            seq_len=seq_len, model_name=model_name)


def evaluate_plan(model: torch.nn.Module, cluster, plan: Plan) -> Plan:
    """Re-price ``plan``'s exact decisions (placements, stages, recompute, ZeRO) on
    ``cluster`` with the cost model, without solving: e.g. after editing placements by
    hand, or to price a saved plan on other hardware. Returns the plan with a new
    ``predicted`` and ``replicated_ops`` (the ops its placements leave whole). Raises
    ValueError when a placement does not exist for this model/tp.
    """
    traced = trace_model(model, plan.seq_len, dtype=plan.dtype)
    decision, tables, strategies = decision_from_plan(traced, cluster, plan)
    pred = predict(traced, strategies, tables, cluster, decision,
                   global_batch_size=plan.global_batch_size)
    return replace(plan, predicted=pred, replicated_ops=replicated_ops(
        traced, strategies, plan.placements, plan.tp, plan.sequence_parallel))


def what_if_plans(model: torch.nn.Module, cluster, chosen: Plan, *, layout: Layout | None = None,
                  progress: Callable[[str], Callable | None] | None = None
                  ) -> dict[str, Plan | str]:
    """Re-plan ``model`` for three changed inputs, for the report's "What if" section
    (:func:`autopar.report.whatif.what_if_markdown`): twice the nodes, twice the global
    batch and, on an A100 cluster, DGX H100 nodes of the same count. Three more searches,
    each about as long as the one that found ``chosen`` (seconds to a minute for big models).

    layout: the fields the user pinned, kept pinned in every what-if (a pin that no longer
        fits, e.g. dp with twice the nodes, makes that what-if a "no plan: ..." string).
    progress: ``progress(label)`` returns the :func:`plan` progress callback for the
        what-if named ``label`` (or None for no display).
    Returns label -> Plan, or the reason there is none (InfeasibleError or ValueError text).
    """
    cases = {"twice the nodes": (replace(cluster, nodes=2 * cluster.nodes),
                                 chosen.global_batch_size),
             "twice the global batch": (cluster, 2 * chosen.global_batch_size)}
    if "A100" in cluster.device.name:
        cases["H100 nodes instead of A100"] = (Cluster.dgx_h100(nodes=cluster.nodes),
                                               chosen.global_batch_size)
    out: dict[str, Plan | str] = {}
    for label, (new_cluster, batch) in cases.items():
        try:
            out[label] = plan(model, new_cluster, global_batch_size=batch,
                              seq_len=chosen.seq_len, layout=layout, model_name=chosen.model,
                              progress=progress(f"what if {label}") if progress else None)
        except (InfeasibleError, ValueError) as exc:
            out[label] = f"no plan: {exc}"
    return out
