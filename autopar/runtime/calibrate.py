"""Measure this machine and write a cluster profile: ``calibrate_local(processes=2)``.

The local-cpu preset is nominal; this replaces it with numbers measured on the spot, each
with the source "measured on <hostname> <date> by autopar calibrate". ``processes`` CPU
ranks (one torch thread each, as the tests run them) on 127.0.0.1 (:func:`autopar.runtime.
launch.launch`) measure all at once, sharing cores and memory as training does:

* ``nn.Linear`` forward and backward (6·m·k·n FLOPs) at widths 64-1024, as a sustained
  rate (:func:`~autopar.runtime.calibrate_comm.mean_time_s`, as every figure below),
  slowest rank: Hockney's r∞ and n½ over the smaller width (``peak_tflops``, ``gemm_half_dim``,
  :func:`cost_models.compute.fit_half_performance`); ``matmul_efficiency`` 1.0;
* causal ``scaled_dot_product_attention`` forward and backward (3 x 4·b·a·s²·hd FLOPs) at
  two head sizes, fitted the same way over min(s, hd) (``attention_*``);
* erf-GELU forward and backward per element (``transcendental_gelems_per_s``);
* per-node overhead (``op_overhead_s``): :class:`autopar.models.GPT` blocks at h = s = 8,
  5 blocks less 1, over 3 x the block's graph nodes; the same blocks checkpointed
  (``recompute_overhead_s``, the extra per node beyond the re-run forward);
* copy bandwidth (reads + writes) and torch's AdamW step as bytes per parameter at it
  (``optimizer_bytes_per_param``);
* ``comm_overlap``: a 4 MiB gloo all-reduce started before matmuls of about its length;
* gloo ``all_reduce`` of 4 B to 16 MiB, each after a burst of compute as in a step
  (:func:`autopar.runtime.calibrate_comm.measure_in_step_s`), fitted by least squares on
  relative residuals to the ring model of :mod:`cost_models.comm`,
  ``T(M) = 2(n-1)·alpha + 2(n-1)/n · M / B``;
* gloo ``all_gather`` into 4 KiB to 2 MiB the same way: its own alpha per ring step
  (``LinkSpec.all_gather_latency_s``) at the all-reduce's B. In a step it costs about 0.8
  of an all-reduce of the same bytes, not the half the ring model gives.

Memory per process is physical memory / ``processes``. Load with ``Cluster.from_json_file``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from autopar.runtime.calibrate_comm import (fit_ring_all_reduce, fit_ring_latency,
                                            mean_time_s, measure_in_step_s, measure_overlap)
from autopar.runtime.launch import launch

__all__ = ["CalibrationSizes", "calibrate_local", "fit_ring_all_reduce", "tiny_block_nodes",
           "host_overheads_s", "measure_host_overheads_s", "TINY_GPT"]


@dataclass(frozen=True)
class CalibrationSizes:
    """What to measure; the defaults take about 40 s on a 2-core host.
    matmul_sizes: n of the n x n fp32 products timed (recorded in the notes).
    matmul_seconds: wall seconds timing each matmul size or linear layer shape.
    linear_shapes: (tokens, in_features, out_features) of the nn.Linear layers timed
        forward and backward for ``peak_tflops`` and ``gemm_half_dim`` (widths 64-256).
    attention_shapes: (heads x batch, s, head dim) of the causal attention timed.
    overhead_seconds: wall seconds spent timing each tiny-block variant.
    overlap_bytes: bytes of the all-reduce whose overlap with matmuls is measured (a
        gradient bucket's order of size).
    copy_bytes: bytes of the tensor copied to measure memory bandwidth.
    all_reduce_bytes: message sizes of the gloo all-reduce sweep, bytes (fp32 elements x 4).
    all_gather_bytes: gathered (output) sizes of the gloo all-gathers timed, bytes.
    all_reduce_seconds: wall seconds spent per all-reduce (or all-gather) size and trial.
    all_reduce_gap_s: seconds of matmuls before each timed collective.
    timeout_s: the spawned ranks are killed after this many seconds.
    """

    matmul_sizes: tuple[int, ...] = (256, 512)
    matmul_seconds: float = 0.6
    linear_shapes: tuple[tuple[int, int, int], ...] = (
        (1024, 64, 256), (1024, 128, 512), (1024, 512, 128), (1024, 256, 256),
        (1024, 256, 1024), (1024, 1024, 256))
    attention_shapes: tuple[tuple[int, int, int], ...] = ((16, 128, 64), (64, 64, 32))
    overhead_seconds: float = 0.6
    overlap_bytes: int = 4 * 2**20
    copy_bytes: int = 256 * 2**20
    all_reduce_bytes: tuple[int, ...] = tuple(4 * 4**k for k in range(12))  # 4 B .. 16 MiB
    all_gather_bytes: tuple[int, ...] = (2**12, 2**16, 2**19, 2**21)  # 4 KiB .. 2 MiB
    all_reduce_seconds: float = 0.4
    all_reduce_gap_s: float = 2e-3
    timeout_s: float = 120.0


TINY_GPT = dict(n_head=2, n_embd=8, vocab_size=16, block_size=8)
"""The reference GPT at negligible size whose blocks measure the host's per-node overhead."""
_BLOCKS = (1, 5)  # block counts timed; their difference isolates the blocks


def _linear_tflops(tokens: int, k: int, n: int, seconds: float) -> float:
    """TFLOP/s of an ``nn.Linear(k, n)``'s forward and backward over ``tokens`` rows
    (y = x Wᵀ + b, dx = dy W, dW = dyᵀ x: 6·tokens·k·n FLOPs)."""
    import torch

    x = torch.randn(tokens, k, requires_grad=True)
    layer, grad = torch.nn.Linear(k, n), torch.randn(tokens, n)
    return 6.0 * tokens * k * n / mean_time_s(lambda: layer(x).backward(grad), seconds) / 1e12


def _attention_tflops(shape: tuple[int, int, int], seconds: float) -> float:
    """TFLOP/s of causal ``scaled_dot_product_attention`` forward and backward on
    (1, heads, s, hd) tensors, counted as the cost model counts it: 3 x 4·heads·s²·hd."""
    import torch
    import torch.nn.functional as F

    heads, s, hd = shape
    q, k, v = (torch.randn(1, heads, s, hd, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, s, hd)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    return 3 * 4.0 * heads * s * s * hd / mean_time_s(run, seconds) / 1e12


def _tiny_blocks_s(seconds: float, device: str = "cpu") -> dict[str, float]:
    """Seconds per tiny GPT block (:data:`TINY_GPT`) of forward + backward on ``device``,
    plain and under non-reentrant checkpointing (``torch.utils.checkpoint``, as full
    recompute runs it): the time of 5 blocks less that of 1, over 4 (median of three). On a
    GPU the kernels are far shorter than their launch, so this is the host's dispatch."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from autopar.models import Block, GPTConfig

    config = GPTConfig(n_layer=max(_BLOCKS), **TINY_GPT)
    blocks = [Block(config).to(device) for _ in range(max(_BLOCKS))]
    x = torch.randn(1, config.block_size, config.n_embd, device=device, requires_grad=True)

    def run(n: int, ckpt: bool):
        y = x
        for block in blocks[:n]:
            y = checkpoint(block, y, use_reentrant=False) if ckpt else block(y)
        y.sum().backward()
    out = {}
    for ckpt in (False, True):  # the median of three differences: one is noisy on a VM
        out["checkpointed" if ckpt else "plain"] = statistics.median(
            (mean_time_s(lambda: run(max(_BLOCKS), ckpt), seconds / 3)
             - mean_time_s(lambda: run(min(_BLOCKS), ckpt), seconds / 3))
            / (max(_BLOCKS) - min(_BLOCKS)) for _ in range(3))
    return out


def host_overheads_s(blocks: dict[str, float], nodes: int) -> tuple[float, float]:
    """(``op_overhead_s``, ``recompute_overhead_s``) from :func:`_tiny_blocks_s`'s seconds
    per block: plain over 3 x the block's ``nodes`` graph nodes (:func:`tiny_block_nodes`;
    forward once, backward twice), and the checkpointed block's extra per node beyond
    re-running the forward."""
    overhead = blocks["plain"] / (3 * nodes)
    return overhead, max(0.0, (blocks["checkpointed"] - blocks["plain"]) / nodes - overhead)


def measure_host_overheads_s(device: str, seconds: float = 1.0) -> tuple[float, float]:
    """:func:`host_overheads_s` measured on ``device`` ("cuda:0": a GPU's host dispatch)."""
    return host_overheads_s(_tiny_blocks_s(seconds, device), tiny_block_nodes())


def _measure_compute(sizes: CalibrationSizes) -> dict:
    """This process's GEMM rates (TFLOP/s: square matmuls per n, linear layers per shape,
    attention), GELU's 1e9 elements/s, tiny-block s, copy GB/s, optimizer bytes/param."""
    import torch
    import torch.nn.functional as F

    flops = {}
    for n in sizes.matmul_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = mean_time_s(lambda: torch.matmul(a, b), sizes.matmul_seconds)
        flops[n] = 2.0 * n**3 / t / 1e12
    linear = {shape: _linear_tflops(*shape, sizes.matmul_seconds) for shape in sizes.linear_shapes}
    attention = {sh: _attention_tflops(sh, sizes.matmul_seconds) for sh in sizes.attention_shapes}
    x, dy = torch.randn(2**18, requires_grad=True), torch.randn(2**18)  # an MLP's (b·s, 4h)
    gelu = 3e-9 * x.numel() / mean_time_s(lambda: F.gelu(x).backward(dy), 0.3)  # 3 shares
    src = torch.empty(sizes.copy_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = mean_time_s(lambda: dst.copy_(src), 0.5)
    copy_gbps = 2.0 * src.numel() * 4 / t / 1e9
    return {"matmul_tflops": flops, "linear_tflops": linear, "attention_tflops": attention,
            "gelu_gelems_per_s": gelu,
            "copy_gbps": copy_gbps, "block_s": _tiny_blocks_s(sizes.overhead_seconds),
            "optimizer_bytes_per_param": _adam_s_per_param() * copy_gbps * 1e9}


def _adam_s_per_param(numel: int = 2**19) -> float:
    """Seconds per parameter of torch's default AdamW step on this device, for one tensor
    of ``numel`` fp32 elements (the runtime steps ZeRO shards in pieces of this size)."""
    import torch

    param = torch.nn.Parameter(torch.ones(numel))
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], lr=1e-3)
    return mean_time_s(opt.step, 0.3) / numel


def _measure(rank: int, world: int, sizes: CalibrationSizes) -> dict:
    """One rank's measurements (run by :func:`autopar.runtime.launch.launch` on every rank):
    after a barrier so that all ranks start together, compute first, then the all-reduce
    and all-gather sweeps."""
    import torch.distributed as dist

    dist.barrier()
    in_step = {kind: measure_in_step_s(kind, getattr(sizes, f"{kind}_bytes"),
                                       sizes.all_reduce_gap_s, sizes.all_reduce_seconds)
               for kind in ("all_reduce", "all_gather")}
    return {"compute": _measure_compute(sizes), "all_reduce_s": in_step["all_reduce"],
            "all_gather_s": in_step["all_gather"], "overlap": measure_overlap(sizes.overlap_bytes)}


def _profile(processes: int, results: list[dict], source: str, sizes: CalibrationSizes) -> dict:
    """The cluster JSON (preset format: every number with its source)."""
    from cost_models.compute import fit_half_performance
    from cost_models.hardware import Cluster

    def slowest(key):  # per entry of a measured dict, the slowest rank's rate
        return {k: min(r["compute"][key][k] for r in results) for k in results[0]["compute"][key]}
    per_size, linear, att = map(slowest, ("matmul_tflops", "linear_tflops", "attention_tflops"))
    rate, half = fit_half_performance([(min(k, n), r) for (_, k, n), r in linear.items()])
    attn_rate, attn_half = fit_half_performance([(min(s, d), r) for (_, s, d), r in att.items()])
    copy = min(r["compute"]["copy_gbps"] for r in results)
    blocks = {k: max(r["compute"]["block_s"][k] for r in results) for k in ("plain", "checkpointed")}
    nodes = tiny_block_nodes()
    overhead, recompute = host_overheads_s(blocks, nodes)
    adam = max(r["compute"]["optimizer_bytes_per_param"] for r in results)
    overlap = min(r["overlap"] for r in results)
    def slowest_s(key):  # per message size, the slowest rank's seconds
        return {m: max(r[key][m] for r in results) for m in results[0][key]}
    times, gathers = slowest_s("all_reduce_s"), slowest_s("all_gather_s")
    alpha, bandwidth = fit_ring_all_reduce(times, processes)
    gather_alpha = fit_ring_latency(gathers, processes, 1, bandwidth)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / processes / 2**30
    nominal = Cluster.local_cpu(processes)

    def num(value, how):
        return {"value": value, "source": f"{source}: {how}"}
    link = {"name": "gloo over loopback TCP", "source": source,
            "bandwidth_gbps": num(bandwidth / 1e9, f"ring all-reduce fit of {len(times)} sizes "
                                  f"{min(times)} B..{max(times)} B (bus bandwidth)"),
            "latency_s": num(alpha, "ring all-reduce fit (per ring step)"),
            "reduce_scatter_as_all_reduce": num(True, "gloo's reduce_scatter_tensor (LinkSpec)"),
            "all_gather_latency_s": num(gather_alpha, f"all-gathers into {min(gathers)} B.."
                                        f"{max(gathers)} B in a step less the ring's bandwidth "
                                        "term at the all-reduce fit's bandwidth, per ring step, "
                                        "median over sizes")}
    return {
        "name": "local-cpu-calibrated", "gpus_per_node": num(processes, "ranks spawned"),
        "nodes": num(1, "one host"), "dtype": nominal.dtype, "attention": nominal.attention,
        "device": {"name": "CPU process (1 thread)", "source": source,
                   "peak_tflops": num(rate, "fp32 nn.Linear forward + backward (6·m·k·n FLOPs) "
                                      f"at (tokens, in, out) = {', '.join(map(str, linear))}, "
                                      "slowest rank, Hockney's r∞ fitted over min(in, out)"),
                   "gemm_half_dim": num(half, "Hockney's n½ of the same fit"),
                   "attention_tflops": num(attn_rate, "fp32 causal scaled_dot_product_attention "
                                           f"forward + backward, (heads, s, hd) = "
                                           f"{', '.join(map(str, att))}, slowest rank, "
                                           "Hockney's r∞ fitted over min(s, hd)"),
                   "attention_half_dim": num(attn_half, "Hockney's n½ of the same fit"),
                   "transcendental_gelems_per_s": num(min(
                       r["compute"]["gelu_gelems_per_s"] for r in results), "fp32 F.gelu (erf) "
                       "forward + backward of 2**18 elements, 3 forward shares each, slowest rank"),
                   "memory_gib": num(mem, f"physical memory / {processes} processes"),
                   "memory_bandwidth_gbps": num(copy, f"copy of {sizes.copy_bytes} B "
                                                         "fp32 (read + write), slowest rank"),
                   "matmul_efficiency": num(1.0, "peak_tflops is the measured matmul rate"),
                   "op_overhead_s": num(overhead, f"forward + backward of a GPT block at "
                                        f"{TINY_GPT} over 3 x its {nodes} graph nodes, slowest "
                                        "rank"),
                   "recompute_overhead_s": num(recompute, "the same blocks checkpointed "
                                               "(non-reentrant) less plain, per node, less "
                                               "op_overhead_s (the re-run forward)"),
                   "comm_overlap": num(overlap, f"all-reduce of {sizes.overlap_bytes} B started "
                                       "before a burst of matmuls of about its length: (T_mm + "
                                       "T_ar - T_both) / min(T_mm, T_ar), median of 5, least rank"),
                   "optimizer_bytes_per_param": num(adam, "torch.optim.AdamW step of 2**19 "
                                                    "fp32 parameters, seconds per "
                                                    "parameter x copy bandwidth, slowest rank")},
        "intra_node": link, "inter_node": dict(link),
        "notes": {"matmul_tflops_by_n": per_size, "all_reduce_s_by_bytes": times,
                  "all_gather_s_by_bytes": gathers,
                  "linear_tflops_by_shape": {str(k): v for k, v in linear.items()},
                  "attention_tflops_by_shape": {str(k): v for k, v in att.items()},
                  "tiny_block_s": blocks,
                  "fit": {"alpha_s": alpha, "bus_bandwidth_bytes_per_s": bandwidth}},
    }


def tiny_block_nodes() -> int:
    """Graph nodes of one :data:`TINY_GPT` block that the cost model charges the host's
    per-node overhead (:func:`autopar.planner.costs.node_cost.dispatches`), from autopar's own
    trace of the model on the meta device."""
    import torch

    from autopar.graph.capture import trace_model
    from autopar.models import GPT, GPTConfig
    from autopar.planner.costs.node_cost import dispatches

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=1, **TINY_GPT))
    traced = trace_model(model, TINY_GPT["block_size"])
    return sum(1 for n in traced.layers[0] if dispatches(traced.nodes[n]))


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
