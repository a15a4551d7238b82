"""Pipeline-parallel step time and bubble.

Symbols: p stages, m micro-batches per step, v virtual stages (model chunks) per
rank for the interleaved schedule, t_i the forward + backward time of one
micro-batch on stage i, c the point-to-point time of one micro-batch across one
stage boundary (activation forward plus its gradient backward).

Bubble fraction (Narayanan et al. 2021, section 2.2): GPipe (Huang et al. 2019)
and 1F1B (PipeDream-flush) idle for (p-1) micro-batch slots at fill and drain
out of m useful ones, so bubble = (p-1)/m; interleaving v chunks per rank makes
each slot v times shorter, so bubble = (p-1)/(v*m).

Zero bubble (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, section 3): a
backward split into B (the input gradient, which the previous stage waits for) and W (the
weight gradient, which nobody waits for) lets a schedule run the W's in the fill and
drain; ZB-H1 (same in-flight activations as 1F1B) shrinks the 1F1B bubble
(p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W) (their section 3.1).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ._checks import check_non_negative, check_positive_int


def bubble_fraction(pp: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle time over useful time: (p-1)/m, or (p-1)/(v*m) with v chunks per rank
    interleaved (Narayanan 2021). ValueError unless p, m and v are positive ints."""
    p = check_positive_int("pp", pp)
    m = check_positive_int("num_micro_batches", num_micro_batches)
    return (p - 1) / (check_positive_int("virtual_stages", virtual_stages) * m)


def pipeline_step_time_s(
    stage_times_s: Sequence[float],
    num_micro_batches: int,
    virtual_stages: int = 1,
    p2p_time_s: float = 0.0,
    deferred_weight_grad_s: Sequence[float] | None = None,
) -> float:
    """Seconds for one pipelined step of m micro-batches (no DP reduction, no optimizer).

    ``stage_times_s[i]`` is t_i, the forward + backward time of ONE micro-batch on
    stage i; ``p2p_time_s`` is c (unused when there is a single stage); v > 1 prices
    interleaving. Which schedule may run which (p, m, v) is its record's rule
    (:mod:`autopar.techniques.pipeline_schedules`), not this formula's.

    GPipe / 1F1B.  The first micro-batch's forward and backward cross every stage
    and every boundary: sum_i t_i + (p-1)*c (fill and drain).  After it the
    pipeline is paced by its slowest stage, which needs max_i(t_i + c) per
    micro-batch, so

        T = (m - 1) * max_i(t_i + c) + sum_i t_i + (p - 1) * c
          = m * M + bubble,   M = max_i(t_i + c),   bubble = sum_i t_i + (p-1)*c - M.

    Both schedules run the same work in the same dependency order, so they share
    this time; they differ in memory (``memory.all_forwards_in_flight``, ``memory.one_forward_one_backward_in_flight``).

    Interleaved 1F1B.  Each rank runs v chunks of t_i/v, and every chunk boundary
    is a point-to-point transfer, so a micro-batch costs the bottleneck rank
    M_v = max_i(t_i + v*c); the fill/drain is made of chunk-sized slots, v times
    shorter:

        T = m * M_v + (sum_i t_i + v*(p-1)*c - M_v) / v

    which equals the GPipe formula at v = 1.  With equal stages t and c = 0 both
    reduce to (m + (p-1)/v) * t = m*t*(1 + bubble_fraction), e.g. (m + p - 1)*t.

    ZB-H1 (``deferred_weight_grad_s``, w_i: the part of t_i that is the weight gradient,
    run in the fill and drain; v = 1): the fill shrinks by :func:`weight_grad_fill_s`.
    """
    times = [check_non_negative(f"stage_times_s[{i}]", t) for i, t in enumerate(stage_times_s)]
    if not times:
        raise ValueError("stage_times_s must hold one time per stage, got an empty sequence")
    p = len(times)
    m = check_positive_int("num_micro_batches", num_micro_batches)
    v = check_positive_int("virtual_stages", virtual_stages)
    c = check_non_negative("p2p_time_s", p2p_time_s)
    if p == 1:
        c = 0.0  # a single stage sends nothing
    steady = max(t + v * c for t in times)  # M_v; M at v = 1
    fill = sum(times)
    if deferred_weight_grad_s is not None:
        fill -= weight_grad_fill_s(deferred_weight_grad_s, p, v)
    bubble = max(0.0, fill + v * (p - 1) * c - steady) / v
    return m * steady + bubble


def weight_grad_fill_s(weight_grad_s: Sequence[float], pp: int, virtual_stages: int = 1
                       ) -> float:
    """Seconds of the fill and drain that the deferred weight gradients w_i fill (ZB-H1).

    Each of the p - 1 fill/drain slots is 2 w shorter (Qi et al. 2024, section 3.1 and
    Table 2: (p-1)(T_F+T_B+T_W) becomes (p-1)(T_F+T_B-T_W)); with unequal stages, the
    slowest stage's own slot kept, 2 (sum_i w_i - max_i w_i), so

        T = (m - 1) * M + sum_i (t_i - 2 w_i) + 2 max_i w_i + (p - 1) * c,

    at least m * M whenever every t_i >= 2 w_i (a stage's W is one of the three GEMMs of
    each of its weights). ValueError unless one w_i >= 0 per stage and v = 1."""
    w = [check_non_negative(f"deferred_weight_grad_s[{i}]", x)
         for i, x in enumerate(weight_grad_s)]
    if len(w) != pp or virtual_stages != 1:
        raise ValueError(f"deferred_weight_grad_s needs one time per stage ({pp}) and v = 1, "
                         f"got {len(w)} times and v = {virtual_stages}")
    return 2 * (sum(w) - max(w))


Order = Sequence[tuple[str, int, int]]
"""A rank's blocks in run order: (kind, micro-batch j, the rank's chunk c); kinds "F"
(forward), "B" (backward; of a split backward, the input gradient), "W" (a split
backward's weight gradient) and "BW" (a split-backward schedule's whole backward, B then W
in one block)."""


def _dependency(kind: str, stage: int, j: int, last: int) -> tuple[str, int, int] | None:
    """The block a (kind, virtual stage, j) block waits for: the previous stage's F, the
    next stage's input gradient ("B" or "BW", both ready as "B"), on the last stage its own
    F; a W its own B."""
    if kind == "F":
        return ("F", stage - 1, j) if stage > 0 else None
    if kind == "W":
        return ("B", stage, j)
    return ("B", stage + 1, j) if stage < last else ("F", stage, j)


def simulate_orders(orders: Sequence[Order], virtual_stage: Callable[[int, int], int],
                    forward_s: Sequence[float], backward_s: Sequence[float], *,
                    recompute_s: Sequence[float], weight_grad_s: Sequence[float] | None,
                    p2p_time_s: float = 0.0, virtual_stages: int = 1
                    ) -> list[list[tuple[str, int, int, float, float, float, float]]]:
    """Every block of one pipelined step, each as soon as possible: per rank, in its
    ``orders[i]``, (kind, j, c, start_s, end_s, recompute_s, send_s).

    Rank i's chunk c is virtual stage ``virtual_stage(i, c)`` of p·v. Each chunk takes 1/v
    of rank i's forward ``forward_s[i]``, backward ``backward_s[i]`` and recompute
    ``recompute_s[i]`` (seconds of one micro-batch through all the rank's chunks). A "B"
    block is the recompute then the backward; with ``weight_grad_s`` (a split backward) it
    leaves the weight gradient w_i/v to a "W" block, which waits for its own B only, and a
    "BW" block runs both. Every "F", "B" and "BW" ends with a send of c/2 (c = ``p2p_time_s``, zero when p = 1) that
    keeps the rank busy, as :func:`pipeline_step_time_s` charges v·c per micro-batch. An
    F waits for the previous virtual stage's F, a B for the next one's B (the last
    stage's B for its own F). Raises RuntimeError when the orders deadlock.
    """
    p, v = len(orders), virtual_stages
    weight = weight_grad_s if weight_grad_s is not None else [0.0] * p
    send = p2p_time_s / 2 if p > 1 else 0.0

    def recompute(kind: str, i: int) -> float:
        return recompute_s[i] / v if kind in ("B", "BW") else 0.0

    def length(kind: str, i: int) -> tuple[float, float]:
        w, rec = weight[i] / v, recompute(kind, i)
        busy = {"F": forward_s[i] / v, "B": backward_s[i] / v - w + rec, "W": w,
                "BW": backward_s[i] / v + rec}[kind]
        return busy, 0.0 if kind == "W" else send

    return [[(kind, j, c, start, start + busy, recompute(kind, i), sent)
             for kind, j, c, start, busy, sent, _ in rank]
            for i, rank in enumerate(_as_soon_as_possible(orders, virtual_stage, length))]


def _as_soon_as_possible(orders: Sequence[Order], virtual_stage: Callable[[int, int], int],
                         length: Callable[[str, int], tuple[float, float]]) -> list[list[tuple]]:
    """Per rank, its blocks run as soon as possible in its order: (kind, j, c, start, busy,
    send, waited), ``length(kind, rank)`` giving (busy, send) seconds; waited is the
    (rank, index) of the block whose end this one started at (its rank's previous block,
    or the block it depends on, :func:`_dependency`), None at time 0. RuntimeError when
    the orders deadlock."""
    p = len(orders)
    last = max(virtual_stage(i, c) for i in range(p) for _, _, c in orders[i])
    done: dict[tuple[str, int, int], tuple[float, tuple[int, int]]] = {}  # input ready
    out: list[list[tuple]] = [[] for _ in range(p)]
    free = [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(p):
            while len(out[i]) < len(orders[i]):
                k = len(out[i])
                kind, j, c = orders[i][k]
                stage = virtual_stage(i, c)
                dep = _dependency(kind, stage, j, last)
                if dep is not None and dep not in done:
                    break
                ready, waited = done[dep] if dep is not None else (0.0, None)
                if ready <= free[i]:
                    ready, waited = free[i], ((i, k - 1) if k else None)
                busy, sent = length(kind, i)
                free[i] = ready + busy + sent
                done[("B" if kind == "BW" else kind, stage, j)] = (free[i], (i, k))
                out[i].append((kind, j, c, ready, busy, sent, waited))
                remaining, progressed = remaining - 1, True
        if not progressed:
            raise RuntimeError(f"the pipeline orders deadlock (p={p})")
    return out


def critical_path(orders: Sequence[Order], virtual_stage: Callable[[int, int], int],
                  lengths: Callable[[str, int], float]) -> tuple[float, dict]:
    """(makespan, blocks on its critical path) of ranks running their ``orders`` as soon as
    possible, block (kind, j, c) of rank i lasting ``lengths(kind, i)`` (its send included),
    dependencies as :func:`simulate_orders`'. The path is counted per (rank, kind): the
    makespan is sum(count * lengths(kind, rank)), a linear form of the lengths that bounds
    the makespan from below for any other lengths (a longest path of the same graph).
    Raises RuntimeError when the orders deadlock."""
    blocks = _as_soon_as_possible(orders, virtual_stage, lambda kind, i: (lengths(kind, i), 0.0))
    ends = [rank[-1][3] + rank[-1][4] if rank else 0.0 for rank in blocks]
    counts: dict[tuple[int, str], int] = {}
    rank = max(range(len(blocks)), key=ends.__getitem__)
    at = (rank, len(blocks[rank]) - 1) if blocks[rank] else None  # the last block to end
    while at is not None:
        block = blocks[at[0]][at[1]]
        counts[(at[0], block[0])] = counts.get((at[0], block[0]), 0) + 1
        at = block[6]
    return max(ends), counts
