"""Does a plan claim what its decisions give? The first check of ``autopar verify``.

A plan records decisions (tp, pp, dp, micro-batching, placements, stages, recompute, ZeRO)
and the cost model's prediction for them. Edit a decision by hand (tp 1 → 2 over
placements made for tp = 1, a ZeRO stage, a stage cut) and the prediction no longer
describes the program that runs: the runtime would execute something, and the losses
would match one device, yet the plan would not be what it says. :func:`claim_problem`
re-prices the plan's exact decisions with the one cost model
(:func:`autopar.api.evaluate_plan`) on the plan's own cluster and compares the result with
what the plan records: step time, per-stage memory and per-kind communication bytes. A
plan written by ``autopar plan`` / ``evaluate`` re-prices to the same numbers (the same
functions on the same data).
"""

from __future__ import annotations

import math

import torch.nn as nn

from autopar.contract.plan import Plan

__all__ = ["claim_problem", "CLAIM_TOLERANCE"]

CLAIM_TOLERANCE = 1e-6
"""Relative difference allowed between a recorded and a re-priced number (JSON keeps
floats exactly; this only absorbs summation order)."""


def _differs(a: float, b: float) -> bool:
    return not math.isclose(a, b, rel_tol=CLAIM_TOLERANCE, abs_tol=1e-12)


def _compare(recorded, repriced) -> list[str]:
    """Which recorded numbers differ from the re-priced ones (names and both values)."""
    out = []
    if _differs(recorded.step_time_s, repriced.step_time_s):
        out.append(f"step time {recorded.step_time_s:.6g} s recorded vs "
                   f"{repriced.step_time_s:.6g} s for these decisions")
    if _differs(recorded.peak_memory_bytes, repriced.peak_memory_bytes):
        out.append(f"peak memory {recorded.peak_memory_bytes:.6g} B recorded vs "
                   f"{repriced.peak_memory_bytes:.6g} B")
    for kind in sorted(set(recorded.comm_bytes_by_kind) | set(repriced.comm_bytes_by_kind)):
        a = recorded.comm_bytes_by_kind.get(kind, 0.0)
        b = repriced.comm_bytes_by_kind.get(kind, 0.0)
        if _differs(a, b):
            out.append(f"{kind} {a:.6g} B recorded vs {b:.6g} B")
    return out


def claim_problem(model: nn.Module, plan: Plan) -> str:
    """"" when ``plan``'s recorded prediction equals a re-pricing of its decisions for
    ``model`` on ``plan.cluster``; else one sentence naming the numbers that differ and the
    fix. Raises the errors of :func:`autopar.api.evaluate_plan` (PlanError: the plan does
    not fit the model)."""
    from autopar.api import evaluate_plan
    from cost_models.hardware import Cluster

    repriced = evaluate_plan(model, Cluster.from_dict(plan.cluster), plan)
    diffs = _compare(plan.predicted, repriced.predicted)
    if not diffs:
        return ""
    return (f"the plan does not describe its own decisions (tp={plan.tp} pp={plan.pp} "
            f"dp={plan.dp}, placements, stages, recompute, zero={plan.zero_stage}): "
            f"{'; '.join(diffs[:3])}. Was it edited by hand? Re-price it with "
            "autopar.evaluate_plan (which writes the matching prediction) or re-plan with "
            "`autopar plan`")
