"""The gloo measurements of :mod:`autopar.runtime.calibrate`: collectives as a training step
meets them, their overlap with compute, and the ring-model fits of the link.

Every function here but the fits runs inside a rank spawned by
:func:`autopar.runtime.launch.launch` (the default process group is initialised).
"""

from __future__ import annotations

import statistics
import time

__all__ = ["mean_time_s", "measure_in_step_s", "measure_overlap", "fit_ring_all_reduce",
           "fit_ring_latency"]


def mean_time_s(fn, seconds: float, min_reps: int = 3) -> float:
    """Sustained wall seconds per ``fn()``: after a warm-up, repetitions back to back for
    ``seconds`` (at least ``min_reps``), elapsed time over repetitions. A training step
    lasts tens to hundreds of milliseconds and so pays its share of whatever else the
    host runs meanwhile; the mean over a window of similar length pays it too (a median
    of short repetitions would pass over it)."""
    fn()
    reps, start = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < seconds:
        fn()
        reps += 1
    return (time.perf_counter() - start) / reps


def _agreed_burst(seconds: float, timing_window_s: float):
    """A function running 256x256 fp32 matmuls for about ``seconds``: the count is timed on
    each rank over ``timing_window_s`` and the least over the ranks taken, so every rank
    runs the same burst."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    one = mean_time_s(lambda: torch.matmul(a, b), timing_window_s)
    reps = torch.tensor([max(1, round(seconds / one))])
    dist.all_reduce(reps, op=dist.ReduceOp.MIN)
    count = int(reps.item())

    def burst():
        for _ in range(count):
            torch.matmul(a, b)
    return burst


def measure_in_step_s(kind: str, sizes_bytes, gap_s: float, seconds: float) -> dict[int, float]:
    """Seconds per gloo collective of ``kind`` ("all_reduce" of a tensor of each size in
    ``sizes_bytes``, or "all_gather" into an output of that size, each rank contributing
    1/n) as a step meets one (slowest rank): each repetition runs matmuls for about
    ``gap_s`` (a layer's compute between collectives), then the collective; (burst +
    collective) less the burst alone, median of five trials of about ``seconds`` / 2.
    Back to back, small ones take 3-10x less on a 2-core VM (the peer's thread awake, both
    arriving together); after compute the waiting rank's thread sleeps, its virtual CPU
    idles and the ranks have drifted apart, as at every step's collective."""
    import torch
    import torch.distributed as dist

    n_ranks = dist.get_world_size()
    burst = _agreed_burst(gap_s, 0.05)
    out = {}
    for nbytes in sizes_bytes:
        if kind == "all_reduce":
            x = torch.ones(max(1, nbytes // 4))
            collective = lambda: dist.all_reduce(x)  # noqa: E731
        else:
            x = torch.ones(max(1, nbytes // 4 // n_ranks))
            y = torch.empty(n_ranks * x.numel())
            collective = lambda: dist.all_gather_into_tensor(y, x)  # noqa: E731

        def both():
            burst()
            collective()
        n = torch.tensor([max(3, int(seconds / 2 / mean_time_s(both, 0, 1)))])
        dist.all_reduce(n, op=dist.ReduceOp.MIN)  # as many collectives on every rank
        trials = []
        for _ in range(5):
            dist.barrier()
            t_both = mean_time_s(both, 0.0, int(n.item()))  # exactly n + 1 on every rank
            trials.append(max(1e-6, t_both - mean_time_s(burst, seconds / 4)))
        t = torch.tensor([statistics.median(trials)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[nbytes] = t.item()
    return out


def _synced_median_s(fn, trials: int) -> float:
    """Median wall seconds of ``fn()`` over ``trials`` runs, each started after a barrier."""
    import torch.distributed as dist

    times = []
    for _ in range(trials):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_overlap(nbytes: int, trials: int = 5) -> float:
    """Fraction of a gloo all-reduce of ``nbytes`` that runs while this rank computes:
    (T_compute + T_all_reduce - T_both) / min(T_compute, T_all_reduce), clamped to [0, 1],
    where T_both starts the all-reduce asynchronously, runs the matmuls, then waits; the
    matmul burst is sized (agreed over the ranks) to last about as long as the all-reduce."""
    import torch
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    t_ar = _synced_median_s(lambda: dist.all_reduce(x), trials)
    burst = _agreed_burst(t_ar, 0.1)

    def both():
        work = dist.all_reduce(x, async_op=True)
        burst()
        work.wait()
    t_c, t_both = _synced_median_s(burst, trials), _synced_median_s(both, trials)
    return min(1.0, max(0.0, (t_c + t_ar - t_both) / min(t_c, t_ar)))


def fit_ring_all_reduce(times_s: dict[int, float], group_size: int) -> tuple[float, float]:
    """(alpha seconds, bus bandwidth bytes/s) of ``T(M) = 2(n-1)·alpha + 2(n-1)/n·M/B``
    (Thakur et al. 2005; cost_models.comm.all_reduce_time_s), least squares on relative
    residuals so that small and large messages count alike. alpha is clamped at 0.

    Raises ValueError for fewer than 2 ranks or sizes, or times that do not grow with size.
    """
    n = group_size
    if n < 2 or len(times_s) < 2:
        raise ValueError(f"fitting a ring needs >= 2 ranks and >= 2 sizes (got n={n}, "
                         f"{len(times_s)} sizes)")
    rows = [(2 * (n - 1) / t, 2 * (n - 1) / n * m / t) for m, t in times_s.items()]
    # minimise sum (alpha*x1 + inv_b*x2 - 1)^2: the 2x2 normal equations
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    r1, r2 = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = s11 * s22 - s12 * s12
    alpha, inv_b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if alpha < 0:  # latency below resolution: bandwidth alone
        alpha, inv_b = 0.0, r2 / s22
    if inv_b <= 0:
        raise ValueError(f"all-reduce times do not grow with message size: {times_s}")
    return alpha, 1.0 / inv_b


def fit_ring_latency(times_s: dict[int, float], group_size: int, rounds: int,
                     bandwidth_bytes_per_s: float) -> float:
    """alpha (seconds per ring step) of a collective of ``rounds`` passes (1: all-gather)
    over ``group_size`` ranks whose bandwidth term is known: the median over sizes M of
    (T(M) - rounds·(n-1)/n·M/B) / (rounds·(n-1)), clamped at 0 (Thakur et al. 2005's ring,
    as :mod:`cost_models.comm` prices it). Raises ValueError for fewer than 2 ranks or no
    sizes."""
    n = group_size
    if n < 2 or not times_s:
        raise ValueError(f"fitting a ring latency needs >= 2 ranks and >= 1 size (got n={n}, "
                         f"{len(times_s)} sizes)")
    steps = rounds * (n - 1)
    return max(0.0, statistics.median(
        (t - steps / n * m / bandwidth_bytes_per_s) / steps for m, t in times_s.items()))
