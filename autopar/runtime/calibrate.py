"""Measure this machine and write a cluster profile: ``calibrate_local(processes=2)``.

The local-cpu preset is nominal; this replaces it with numbers measured on the spot, each
with the source "measured on <hostname> <date> by autopar calibrate". ``processes`` CPU
ranks (one torch thread each, as the gloo tests and examples run them) are started on
127.0.0.1 by :func:`autopar.runtime.launch.launch` and, all at once so that they share cores and memory the way training does,
measure

* fp32 ``torch.matmul`` throughput of square n x n x n products (2·n³ FLOPs each), the
  steady state being the median of timed repetitions after a warm-up; the device's
  ``peak_tflops`` is the best size's rate, slowest rank, with ``matmul_efficiency`` 1.0;
* memory bandwidth from a large tensor copy (reads + writes: 2 x bytes per copy);
* torch's default AdamW step per parameter, as the bytes per parameter it moves at that
  bandwidth (``DeviceSpec.optimizer_bytes_per_param``);
* gloo ``all_reduce`` of 4 B to 16 MiB, fitted by weighted least squares (relative
  residuals) to the ring model of :mod:`cost_models.comm`,
  ``T(M) = 2(n-1)·alpha + 2(n-1)/n · M / B``, giving the link's latency alpha (seconds)
  and bus bandwidth B (bytes/s).

Memory per process is the host's physical memory divided by ``processes``. The profile
loads with :meth:`cost_models.hardware.Cluster.from_json_file`.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from autopar.runtime.launch import launch

__all__ = ["CalibrationSizes", "calibrate_local", "fit_ring_all_reduce"]


@dataclass(frozen=True)
class CalibrationSizes:
    """What to measure; the defaults take about 15-25 s on a 2-core host.

    matmul_sizes: n of the n x n fp32 products timed.
    matmul_seconds: wall seconds spent timing each matmul size (after one warm-up run).
    copy_bytes: bytes of the tensor copied to measure memory bandwidth.
    all_reduce_bytes: message sizes of the gloo all-reduce sweep, bytes (fp32 elements x 4).
    all_reduce_seconds: wall seconds spent per all-reduce size (at least 3 repetitions).
    timeout_s: the spawned ranks are killed after this many seconds.
    """

    matmul_sizes: tuple[int, ...] = (256, 512, 1024)
    matmul_seconds: float = 1.0
    copy_bytes: int = 256 * 2**20
    all_reduce_bytes: tuple[int, ...] = tuple(4 * 4**k for k in range(12))  # 4 B .. 16 MiB
    all_reduce_seconds: float = 0.4
    timeout_s: float = 120.0


def _median_time_s(fn, seconds: float, min_reps: int = 3) -> float:
    """Median wall time of ``fn()`` over repetitions filling ``seconds`` (after a warm-up)."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_CHAIN = 50


def _tiny_chain() -> None:
    """Forward and backward through a chain of tiny element-wise ops: all dispatch and
    autograd bookkeeping, no arithmetic to speak of."""
    import torch

    x = torch.ones(8, requires_grad=True)
    y = x
    for _ in range(_CHAIN):
        y = y * 1.0001
    y.sum().backward()


def _measure_compute(sizes: CalibrationSizes) -> dict:
    """fp32 matmul TFLOP/s per size and copy bandwidth (GB/s) of this process."""
    import torch

    flops = {}
    for n in sizes.matmul_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = _median_time_s(lambda: torch.matmul(a, b), sizes.matmul_seconds)
        flops[n] = 2.0 * n**3 / t / 1e12
    src = torch.empty(sizes.copy_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _median_time_s(lambda: dst.copy_(src), 0.5)
    op = _median_time_s(_tiny_chain, 0.3) / (3 * _CHAIN)  # backward ~ 2x forward ops
    copy_gbps = 2.0 * src.numel() * 4 / t / 1e9
    return {"matmul_tflops": flops, "copy_gbps": copy_gbps, "op_overhead_s": op,
            "optimizer_bytes_per_param": _adam_s_per_param() * copy_gbps * 1e9}


def _adam_s_per_param(numel: int = 2**19) -> float:
    """Seconds per parameter of torch's default AdamW step on this device, for one tensor
    of ``numel`` fp32 elements (the runtime steps ZeRO shards in pieces of this size)."""
    import torch

    param = torch.nn.Parameter(torch.ones(numel))
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], lr=1e-3)
    return _median_time_s(opt.step, 0.3) / numel


def _measure_all_reduce(sizes: CalibrationSizes) -> dict[int, float]:
    """Seconds per gloo all_reduce of each size (slowest rank): back-to-back repetitions
    after a barrier, the per-operation time of the median of three trials."""
    import torch
    import torch.distributed as dist

    out = {}
    for nbytes in sizes.all_reduce_bytes:
        x = torch.ones(max(1, nbytes // 4))
        dist.all_reduce(x)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        one = max(time.perf_counter() - t0, 1e-6)
        guess = max(3, min(200, int(sizes.all_reduce_seconds / 3 / one)))
        agreed = torch.tensor([guess])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank must run as many
        reps = int(agreed.item())
        trials = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            trials.append((time.perf_counter() - t0) / reps)
        t = torch.tensor([statistics.median(trials)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[nbytes] = t.item()
    return out


def _measure(rank: int, world: int, sizes: CalibrationSizes) -> dict:
    """One rank's measurements (run by :func:`autopar.runtime.launch.launch` on every rank):
    after a barrier so that all ranks start together, compute first, then the all-reduce
    sweep."""
    import torch.distributed as dist

    dist.barrier()
    return {"compute": _measure_compute(sizes), "all_reduce_s": _measure_all_reduce(sizes)}


def fit_ring_all_reduce(times_s: dict[int, float], group_size: int) -> tuple[float, float]:
    """(alpha seconds, bus bandwidth bytes/s) of ``T(M) = 2(n-1)·alpha + 2(n-1)/n·M/B``
    (Thakur et al. 2005; cost_models.comm.all_reduce_time_s), least squares on relative
    residuals so that small and large messages count alike. alpha is clamped at 0."""
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


def _profile(processes: int, results: list[dict], source: str, sizes: CalibrationSizes) -> dict:
    """The cluster JSON (preset format: every number with its source)."""
    from cost_models.hardware import Cluster

    per_size = {n: min(r["compute"]["matmul_tflops"][n] for r in results)
                for n in sorted(results[0]["compute"]["matmul_tflops"])}
    best = max(per_size, key=per_size.get)
    copy = min(r["compute"]["copy_gbps"] for r in results)
    overhead = max(r["compute"]["op_overhead_s"] for r in results)
    adam = max(r["compute"]["optimizer_bytes_per_param"] for r in results)
    times = {m: max(r["all_reduce_s"][m] for r in results) for m in results[0]["all_reduce_s"]}
    alpha, bandwidth = fit_ring_all_reduce(times, processes)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / processes / 2**30
    nominal = Cluster.local_cpu(processes)

    def num(value, how):
        return {"value": value, "source": f"{source}: {how}"}

    link = {"name": "gloo over loopback TCP", "source": source,
            "bandwidth_gbps": num(bandwidth / 1e9, f"ring all-reduce fit of {len(times)} sizes "
                                  f"{min(times)} B..{max(times)} B (bus bandwidth)"),
            "latency_s": num(alpha, "ring all-reduce fit (per ring step)")}
    return {
        "name": "local-cpu-calibrated", "gpus_per_node": num(processes, "ranks spawned"),
        "nodes": num(1, "one host"), "dtype": nominal.dtype, "attention": nominal.attention,
        "device": {"name": "CPU process (1 thread)", "source": source,
                   "peak_tflops": num(per_size[best],
                                      f"fp32 torch.matmul {best}^3, median, slowest rank"),
                   "memory_gib": num(mem, f"physical memory / {processes} processes"),
                   "memory_bandwidth_gbps": num(copy, f"copy of {sizes.copy_bytes} B "
                                                         "fp32 (read + write), slowest rank"),
                   "matmul_efficiency": num(1.0, "peak_tflops is the measured matmul rate"),
                   "op_overhead_s": num(overhead, "forward+backward of a chain of tiny ops / "
                                                  "(3 x ops), median, slowest rank"),
                   "optimizer_bytes_per_param": num(adam, "torch.optim.AdamW step of 2**19 "
                                                    "fp32 parameters, median seconds per "
                                                    "parameter x copy bandwidth, slowest rank")},
        "intra_node": link, "inter_node": dict(link),
        "notes": {"matmul_tflops_by_n": per_size, "all_reduce_s_by_bytes": times,
                  "fit": {"alpha_s": alpha, "bus_bandwidth_bytes_per_s": bandwidth}},
    }


def calibrate_local(processes: int = 2, out_path: str | None = None,
                    sizes: CalibrationSizes = CalibrationSizes()) -> dict:
    """Measure ``processes`` local CPU ranks and return (and, with ``out_path``, write) a
    cluster profile JSON dict that :meth:`Cluster.from_json_file` / ``from_dict`` load.

    Raises ValueError for processes < 2 (one rank has no link to fit), RuntimeError or
    TimeoutError when a rank fails or hangs (the ranks are killed).
    """
    if not isinstance(processes, int) or processes < 2:
        raise ValueError(f"calibrate_local needs processes >= 2 to measure gloo, got {processes!r}")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    source = f"measured on {socket.gethostname()} {stamp} by autopar calibrate"
    results = launch(_measure, processes, sizes, timeout_s=sizes.timeout_s,
                     pg_timeout_s=sizes.timeout_s)
    profile = _profile(processes, results, source, sizes)
    profile["notes"]["sizes"] = asdict(sizes)
    if out_path is not None:
        Path(out_path).write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    return profile
