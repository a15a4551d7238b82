"""Does a saved plan fit this model? The half of the plan validator that needs the model
(the other half, the plan's own schema and arithmetic, is :mod:`autopar.contract.plan_check`).

:func:`check_plan_fits_model` is called by every reader that holds the model:
``evaluate_plan``, ``autopar verify`` and ``parallelize`` (through
:func:`autopar.recipe.check_plan_matches`), before any collective. It checks
the model config, seq_len against the model's maximum positions, the layer count against
the plan's recompute list and stages, the traced node names against the placements, and
that every placement is a strategy of its node at the plan's tp (so an edited plan asks
for nothing the rewrite would have to invent). Each failure is a
:class:`~autopar.contract.plan_check.PlanError` naming the field and the fix.
"""

from __future__ import annotations

import torch.nn as nn

from autopar.graph.annotate import TracedModel
from autopar.graph.context_parallel import context_parallel_trace
from autopar.models import default_seq_len, model_config
from autopar.contract.plan import Plan
from autopar.contract.plan_check import PlanError
from autopar.planner.strategies import decode_placements

__all__ = ["check_plan_fits_model", "check_seq_len"]

REPLAN_MODEL = "pass the model the plan was made for, or re-plan this model with `autopar plan`"


def check_seq_len(model: nn.Module, seq_len: int, where: str = "seq_len") -> None:
    """ValueError when ``seq_len`` exceeds the model's maximum positions
    (:func:`~autopar.models.default_seq_len`: block_size, n_positions or
    max_position_embeddings); a model without such a config is not checked."""
    limit = default_seq_len(model)
    if limit is not None and seq_len > limit:
        raise ValueError(f"{where}={seq_len} exceeds the model's {limit} positions (its "
                         "config's block_size / n_positions / max_position_embeddings); "
                         f"choose {where} <= {limit}")


def _check_config(plan: Plan, model: nn.Module, src: str) -> None:
    config = model_config(model)
    if plan.model_config and config and plan.model_config != config:
        diff = {k: (plan.model_config.get(k), config.get(k))
                for k in sorted(set(plan.model_config) | set(config))
                if plan.model_config.get(k) != config.get(k)}
        raise PlanError(src, "model_config", f"was made for model {plan.model!r} with a "
                        f"different config (plan vs model: {diff})", REPLAN_MODEL)


def check_plan_fits_model(plan: Plan, model: nn.Module, traced: TracedModel | None = None,
                          source: str = "plan") -> TracedModel:
    """Raise :class:`~autopar.contract.plan_check.PlanError` unless ``plan`` fits ``model``
    (module docstring); ``traced``: the model's trace in the plan's dtype when the caller
    has one. Returns the trace. Local: no collective."""
    src = source
    _check_config(plan, model, src)
    try:
        check_seq_len(model, plan.seq_len)
    except ValueError as exc:
        raise PlanError(src, "seq_len", str(exc), "re-plan with a smaller --seq-len") from None
    traced = traced or context_parallel_trace(model, plan.seq_len, plan.cp, dtype=plan.dtype)
    names = {n.name for n in traced.gm.graph.nodes}
    missing, extra = sorted(set(plan.placements) - names), sorted(names - set(plan.placements))
    if missing or extra:
        raise PlanError(src, "placements", f"were made for model {plan.model!r}, whose traced "
                        f"graph differs from this model's: {len(missing)} plan nodes are not in "
                        f"the model (e.g. {missing[:3]}), {len(extra)} model nodes are not in "
                        f"the plan (e.g. {extra[:3]})", REPLAN_MODEL)
    if traced.num_layers != len(plan.recompute):
        raise PlanError(src, "recompute", f"has {len(plan.recompute)} modes but the model has "
                        f"{traced.num_layers} layers (one mode per layer)", REPLAN_MODEL)
    try:
        decode_placements(traced, plan.placements, plan.tp, plan.sequence_parallel, plan.ep)
    except ValueError as exc:
        raise PlanError(src, "placements", f"ask for a strategy this model's node does not "
                        f"have at tp={plan.tp}: {exc}", REPLAN_MODEL) from None
    return traced
