"""Decision ↔ Plan: what the solver (or the exhaustive oracle) decides for one Config, and
the :class:`~autopar.contract.plan.Plan` it becomes, in one place.

A :class:`Decision` indexes strategies (per node, into
:func:`~autopar.planner.strategies.node_strategies`); a Plan stores their keys. Stage bounds
and per-layer recompute modes come from per-rank counts (:func:`stage_bounds_and_recompute`),
within :data:`STAGE_SLACK` layers of an even split (:func:`stage_size_range`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from autopar.graph.annotate import TracedModel
from autopar.models import model_config
from autopar.contract.plan import Alternative, Plan, equal_chunks, rank_layers
from autopar.contract.plan_memory import binding_stage, memory_line
from autopar.planner.costs.tables import Config, CostTables, cost_tables
from autopar.planner.costs.predict import predict
from autopar.planner.strategies.replicated import replicated_ops
from autopar.planner.strategies import NodeStrategies, decode_placements, node_strategies

__all__ = ["Decision", "InfeasibleError", "STAGE_SLACK", "stage_size_range", "stage_splits",
           "stage_bounds_and_recompute", "plan_from_decision", "decision_from_plan",
           "peak_memory_line"]

STAGE_SLACK = 2
"""Pipeline rank i holds L/p ± STAGE_SLACK layers (the plan space of the solver and the oracle)."""


class InfeasibleError(Exception):
    """No plan fits; the message gives the smallest memory any plan needs vs the device and
    what the search found per mesh shape."""


@dataclass
class Decision:
    """What CP-SAT (or the exhaustive oracle) decided for one Config.

    config: the mesh shape and micro-batching; strategy: per node of the full graph, the
    index of its strategy in ``node_strategies``; stage_layers, recompute: as
    :class:`~autopar.contract.plan.Plan`'s; zero_stage: ZeRO stage; objective_s: the solver's step
    time (seconds, its integer rounding); solve_time_s: wall seconds of the solve.
    """

    config: Config
    strategy: dict[str, int]
    stage_layers: list[list[int]]
    recompute: list[str]
    zero_stage: int
    objective_s: float
    solve_time_s: float


def stage_size_range(num_layers: int, pp: int) -> tuple[int, int]:
    """(fewest, most) layers one pipeline rank may hold: within :data:`STAGE_SLACK` of
    L/p, at least 1, and leaving at least one layer to each other rank."""
    L, p = num_layers, pp
    return max(1, L // p - STAGE_SLACK), min(L - p + 1, -(-L // p) + STAGE_SLACK)


def stage_splits(num_layers: int, pp: int, virtual_stages: int = 1) -> list[tuple[int, ...]]:
    """Every tuple of per-rank layer counts the plan space holds: each within
    :func:`stage_size_range`, summing to L (the CP-SAT model's ``layers[i]``); interleaved
    (v > 1) only the even split, L/p layers per rank."""
    if virtual_stages > 1:
        return [(num_layers // pp,) * pp]
    lo, hi = stage_size_range(num_layers, pp)
    return [s for s in itertools.product(range(lo, hi + 1), repeat=pp) if sum(s) == num_layers]


def stage_bounds_and_recompute(layers: list[int], counts: list[tuple[int, int]],
                               virtual_stages: int = 1, *, schedule: str
                               ) -> tuple[list[list[int]], list[str]]:
    """``Plan.stage_layers`` and the per-layer recompute modes from per-rank layer counts
    and (full, selective) recompute counts. v = 1: contiguous stages, each with its full
    then selective then plain layers. v > 1: p·v equal chunks (every count L/p), placed by
    ``schedule``'s record (round-robin or V); rank i's recompute modes fill its layers in ascending order (the cost
    model prices a rank's layers alike, so the order does not matter)."""
    p, L = len(layers), sum(layers)
    if virtual_stages == 1:
        bounds, start = [], 0
        for count in layers:
            bounds.append([start, start + count])
            start += count
    else:
        bounds = equal_chunks(L, p * virtual_stages)
    recompute = ["none"] * L
    for i, (rf, rs) in enumerate(counts):
        mine = rank_layers(bounds, p, i, schedule=schedule)
        for l, mode in zip(mine, ["full"] * rf + ["selective"] * rs):
            recompute[l] = mode
    return bounds, recompute


def peak_memory_line(predicted, cluster) -> str:
    """The plan's binding line: the pipeline stage with the least margin, its peak and
    reserve against the device (the CP-SAT row of that stage is ``memory[stage i]``,
    :func:`autopar.contract.plan_memory.memory_line`)."""
    device = cluster.device.memory_bytes
    i = binding_stage(predicted, device)
    return f"memory[stage {i}]: " + memory_line(predicted, device).split(": ", 1)[1]


def plan_from_decision(traced: TracedModel, model, cluster, decision: Decision,
                       tables: CostTables, strategies: NodeStrategies, *,
                       global_batch_size: int, seq_len: int, model_name: str,
                       seen: list[Alternative] = ()) -> Plan:
    """The :class:`~autopar.contract.plan.Plan` of ``decision``: its placements (strategy keys), the
    :func:`~autopar.planner.costs.predict.predict` prediction,
    up to five faster-first feasible alternatives and three infeasible ones from ``seen``
    (the search's per-config records), the binding line (:func:`peak_memory_line`) and
    the ops TP leaves whole (:func:`~autopar.planner.strategies.replicated.replicated_ops`).
    ``global_batch_size`` and ``seq_len``: the plan's B and s (``traced`` is at s/c tokens
    under context parallelism, :mod:`autopar.graph.context_parallel`)."""
    cfg = decision.config  # under context parallelism dp = c·d over c·B rows of s/c tokens
    pred = predict(traced, strategies, tables, cluster, decision,
                   global_batch_size=global_batch_size * cfg.cp)
    placements = {name: strategies[name][k].key for name, k in decision.strategy.items()}
    feasible = sorted((s for s in seen if s.feasible), key=lambda s: s.step_time_s)
    others = [alt if alt.layout.get("cp", 1) == 1 else replace(alt, layout={  # d, not c·d
        **alt.layout, "dp": alt.layout["dp"] // alt.layout["cp"]})
        for alt in feasible[1:6] + [s for s in seen if s.feasible is False][:3]]
    return Plan(model=model_name, model_config=model_config(model), cluster=cluster.to_dict(),
                global_batch_size=global_batch_size, seq_len=seq_len, tp=cfg.tp, pp=cfg.pp,
                dp=cfg.dp // cfg.cp, cp=cfg.cp, micro_batch_size=cfg.micro_batch_size,
                num_micro_batches=cfg.num_micro_batches, schedule=cfg.schedule,
                zero_stage=decision.zero_stage, recompute=decision.recompute,
                stage_layers=decision.stage_layers, placements=placements, predicted=pred,
                virtual_stages=cfg.virtual_stages, sequence_parallel=cfg.sequence_parallel,
                dtype=cfg.dtype, grad_dtype=cfg.grads, ep=cfg.ep,
                attention=cfg.attention if cfg.attention != cluster.attention else None,
                alternatives=others,
                binding=[peak_memory_line(pred, cluster)],
                replicated_ops=replicated_ops(traced, strategies, placements, cfg.tp,
                                              cfg.sequence_parallel))


def decision_from_plan(traced: TracedModel, cluster, plan: Plan
                       ) -> tuple[Decision, CostTables, NodeStrategies]:
    """``plan``'s exact decisions (placements, stages, recompute, ZeRO) as a Decision on
    ``cluster``, with the cost tables and strategies to price it (``traced``: the model at
    s/c tokens, :func:`~autopar.graph.context_parallel.context_parallel_trace`). Raises ValueError when a
    placement does not exist for this model at the plan's tp
    (:func:`~autopar.planner.strategies.decode_placements`)."""
    cfg = Config(plan.tp, plan.pp, plan.dp * plan.cp, plan.micro_batch_size,
                 plan.num_micro_batches, plan.schedule, plan.virtual_stages, plan.dtype,
                 plan.attention or cluster.attention,
                 plan.sequence_parallel, plan.grad_dtype, plan.ep, plan.cp)
    strategies = node_strategies(traced, plan.tp, plan.sequence_parallel, plan.ep)
    decoded = decode_placements(traced, plan.placements, plan.tp, plan.sequence_parallel,
                                plan.ep)
    choice = {name: k for name, (k, _) in decoded.items()}
    decision = Decision(cfg, choice, plan.stage_layers, plan.recompute, plan.zero_stage, 0.0, 0.0)
    return decision, cost_tables(traced, strategies, cluster, cfg), strategies
