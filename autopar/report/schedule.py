r"""The pipeline schedule a plan is priced with, laid out in time: which forward and
backward of which micro-batch chunk each pipeline rank runs when, for the report's timeline.

Inputs are the cost model's own numbers (``Prediction.stage_phase_s``): per pipeline rank
i, the seconds one micro-batch spends in the forward :math:`f_i`, the backward
:math:`b_i` and the recompute :math:`r_i` of all the rank's layers (TP communication
included), and the point-to-point time c of one chunk boundary (activation forward plus
gradient backward). As in :mod:`cost_models.pipeline`, each of the rank's v chunks takes
1/v of each, and every chunk's forward and backward end with a send of c/2 that keeps the
rank busy, so a rank is busy :math:`t_i + v c` per micro-batch,
:math:`t_i = f_i + b_i + r_i`, the cost model's :math:`M_v`. A backward block starts with
the recompute (the forward re-run of full or selective recompute), so it is
:math:`(b_i + r_i)/v` long.

The order in which each rank runs its blocks is the schedule record's drawing
(:mod:`autopar.techniques.pipeline_schedules`: GPipe, 1F1B, interleaved 1F1B, ZB-H1; on
rank i chunk c is virtual stage :math:`c p + i`, the model chunk :math:`c p + i` of
``Plan.stage_layers``). A schedule that splits the backward (ZB-H1) runs it as a "B" block
(the recompute, then the input gradient: :math:`(b_i + r_i - w_i)/v`, sent to the previous
stage) and a "W" block (the weight gradient :math:`w_i/v`, the phases' "weight_grad",
which sends nothing and waits only for its rank).

Every block starts as soon as its rank is free and its input has arrived (the forward of
the previous virtual stage, the backward of the next one, or on the last virtual stage its
own forward). With equal stages the drawn makespan is the cost model's pipeline time plus
exactly c (the cost model's fill and drain cross p - 1 boundaries, the drawing charges
every chunk's sends); :func:`makespan_s`. Pure Python: no planner, no plotting.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.pipeline import simulate_orders
from autopar.techniques.pipeline_schedules import pipeline_schedule

__all__ = ["Block", "schedule_order", "simulate_schedule", "makespan_s", "plan_phases",
           "plan_timeline", "drawn_micro_batches", "BACKWARD_OVER_FORWARD"]

BACKWARD_OVER_FORWARD = 2.0
"""Plans saved before ``stage_phase_s`` existed are drawn with backward = 2 × forward (two
matmuls per forward matmul; Narayanan et al. 2021, section 3.5) and no recompute."""


@dataclass(frozen=True)
class Block:
    """One forward or backward of one micro-batch through one chunk on a pipeline rank.

    kind: "F" (forward), "B" (backward: the recompute first, then the backward; of a
    split backward, the input gradient) or "W" (a split backward's weight gradient).
    micro_batch: j in 0..m-1. chunk: the rank's model chunk c in 0..v-1 (virtual stage
    c·p + rank). start_s, end_s: seconds from the start of the step, compute only.
    recompute_s: the part of a "B" spent re-running the forward. send_s: the
    point-to-point send after ``end_s`` (c/2), the rank busy until ``end_s + send_s``.
    """

    kind: str
    micro_batch: int
    chunk: int
    start_s: float
    end_s: float
    recompute_s: float = 0.0
    send_s: float = 0.0


def schedule_order(schedule: str, pp: int, m: int, rank: int,
                   virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """The order in which pipeline rank ``rank`` runs its blocks: (kind "F"/"B"/"W",
    micro-batch, chunk), the record's ``order``. Raises ValueError for an unknown
    schedule, or interleaved 1F1B with m not a multiple of p (its order needs whole groups
    of p micro-batches)."""
    return pipeline_schedule(schedule).order(pp, m, rank, virtual_stages)


def simulate_schedule(schedule: str, pp: int, m: int, forward_s: list[float],
                      backward_s: list[float], *, recompute_s: list[float] | None = None,
                      p2p_s: float = 0.0, virtual_stages: int = 1,
                      weight_grad_s: list[float] | None = None) -> list[list[Block]]:
    """Every block of one step on every pipeline rank, as soon as possible (module
    docstring). ``forward_s[i]``, ``backward_s[i]``, ``recompute_s[i]``: seconds of one
    micro-batch through all of rank i's chunks (a chunk takes 1/v); ``weight_grad_s[i]``:
    the part of ``backward_s[i]`` a split backward runs as "W" (default 0); ``p2p_s``: c,
    one chunk boundary's transfer forward and backward (ignored when p = 1). Returns per
    rank its blocks in run order. Raises ValueError (not one time per rank, an unknown
    schedule) and RuntimeError if the order deadlocks."""
    v, recompute_s = virtual_stages, recompute_s or [0.0] * pp
    weight_s = weight_grad_s or [0.0] * pp
    if not len(forward_s) == len(backward_s) == len(recompute_s) == len(weight_s) == pp:
        raise ValueError(f"need one forward and one backward time per stage (pp={pp}), and "
                         f"one recompute and one weight-gradient time when given; got "
                         f"{len(forward_s)}, {len(backward_s)}, {len(recompute_s)} and "
                         f"{len(weight_s)}")
    record = pipeline_schedule(schedule)
    orders = [record.order(pp, m, i, v) for i in range(pp)]
    chunks = [record.rank_chunks(pp, pp * v, i) for i in range(pp)]
    try:
        blocks = simulate_orders(orders, lambda i, c: chunks[i][c], forward_s, backward_s,
                                 recompute_s=recompute_s,
                                 weight_grad_s=weight_s if record.split_backward else None,
                                 p2p_time_s=p2p_s, virtual_stages=v)
    except RuntimeError:
        raise RuntimeError(f"schedule {schedule!r} deadlocks with pp={pp}, m={m}, v={v}") from None
    return [[Block(*block) for block in rank] for rank in blocks]


def makespan_s(timeline: list[list[Block]]) -> float:
    """Seconds from the first block's start to the last send's end."""
    return max((b.end_s + b.send_s for blocks in timeline for b in blocks), default=0.0)


def plan_phases(plan) -> tuple[list[float], list[float], list[float], float]:
    """(forward, backward, recompute seconds per rank, c) of ``plan`` (a
    :class:`~autopar.contract.plan.Plan`) from ``predicted.stage_phase_s``; for a plan saved
    without it, ``stage_time_s`` split 1 : :data:`BACKWARD_OVER_FORWARD` and c from
    ``time_s_by_kind["pp_p2p"]`` (m·v·c)."""
    p, pred = plan.pp, plan.predicted
    phases = pred.stage_phase_s
    if len(phases) == p:
        return ([s["forward"] for s in phases], [s["backward"] for s in phases],
                [s["recompute"] for s in phases], phases[0]["p2p"])
    fwd = [t / (1 + BACKWARD_OVER_FORWARD) for t in pred.stage_time_s]
    hops = plan.num_micro_batches * plan.virtual_stages
    return (fwd, [t - f for t, f in zip(pred.stage_time_s, fwd)], [0.0] * len(fwd),
            pred.time_s_by_kind.get("pp_p2p", 0.0) / hops)


def drawn_micro_batches(schedule: str, pp: int, m: int, limit: int,
                        virtual_stages: int = 1) -> int:
    """How many micro-batches a timeline of about ``limit`` draws: m when m <= limit, else
    the fewest from ``limit`` up that fill the pipeline (p, or 2p on a V: its warm-up runs
    2p - 1 forwards) and that the schedule's rule accepts with v = ``virtual_stages``
    (interleaved 1F1B: a multiple of p; DualPipeV: m >= 2p), at most m."""
    if m <= limit:
        return m
    record = pipeline_schedule(schedule)
    fill = 2 * pp if record.placement == "v" else pp
    return next((k for k in range(max(limit, fill), m)
                 if record.problem(pp, k, virtual_stages) is None), m)


def plan_timeline(plan, micro_batches: int | None = None) -> list[list[Block]]:
    """:func:`simulate_schedule` of ``plan``'s own schedule, v and phases
    (:func:`plan_phases`), over its m micro-batches or the first ``micro_batches``."""
    fwd, bwd, rec, c = plan_phases(plan)
    m = plan.num_micro_batches if micro_batches is None else micro_batches
    phases = plan.predicted.stage_phase_s
    weight = [s.get("weight_grad", 0.0) for s in phases] if len(phases) == plan.pp else None
    return simulate_schedule(plan.schedule, plan.pp, m, fwd, bwd, recompute_s=rec, p2p_s=c,
                             virtual_stages=plan.virtual_stages, weight_grad_s=weight)
