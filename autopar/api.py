"""The public face: ``plan``, ``evaluate``, ``evaluate_plan`` and ``load_model``.

Thin: tracing (:mod:`autopar.graph`), the search (:mod:`autopar.planner.search`) and
Decision ↔ Plan (:mod:`autopar.planner.decision`) do the work.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Callable

import torch

from autopar.graph.annotate import TracedModel
from autopar.plan import Layout, Plan
from autopar.planner.decision import decision_from_plan, model_config, plan_from_decision
from autopar.planner.predict import predict
from autopar.support import RUNTIME_SUPPORT
from autopar.planner.search import SearchResult, search
from autopar.graph.capture import trace_model

__all__ = ["plan", "evaluate", "evaluate_plan", "load_model", "plan_from_search"]


def load_model(spec: str) -> tuple[torch.nn.Module, str]:
    """Build a model on the meta device from a preset name or ``module:factory``.

    Raises ValueError for an unknown preset or a factory that cannot be imported.
    """
    from autopar.models import GPT, PRESETS

    if ":" not in spec:
        if spec not in PRESETS:
            raise ValueError(f"unknown model {spec!r}: use a preset ({', '.join(sorted(PRESETS))}) "
                             "or module:factory")
        with torch.device("meta"):
            return GPT(PRESETS[spec]), spec
    module_name, _, factory = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), factory)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load model factory {spec!r}: {exc}") from exc
    with torch.device("meta"):
        return fn(), spec


_model_config = model_config  # kept for autopar.verify.check, which imports this name


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
    traced = trace_model(model, seq_len, name=model_name)
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
    traced = trace_model(model, seq_len, name=model_name)
    result = search(traced, cluster, global_batch_size, layout, support=None, even_stages=True)
    return plan_from_search(traced, model, cluster, result, global_batch_size=global_batch_size,
                            seq_len=seq_len, model_name=model_name)


def evaluate_plan(model: torch.nn.Module, cluster, plan: Plan) -> Plan:
    """Re-price ``plan``'s exact decisions (placements, stages, recompute, ZeRO) on
    ``cluster`` with the cost model, without solving: e.g. after editing placements by
    hand, or to price a saved plan on other hardware. Returns the plan with a new
    ``predicted``. Raises ValueError when a placement does not exist for this model/tp.
    """
    traced = trace_model(model, plan.seq_len)
    decision, tables, strategies = decision_from_plan(traced, cluster, plan)
    pred = predict(traced, strategies, tables, cluster, decision,
                   global_batch_size=plan.global_batch_size)
    return replace(plan, predicted=pred)
