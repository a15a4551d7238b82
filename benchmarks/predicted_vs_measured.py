"""Predicted vs measured step time of small-GPT layouts on 2 local CPU ranks (gloo).

    python benchmarks/predicted_vs_measured.py [--save-cluster PATH] [--cluster PATH]

1. calibrates this machine three times and takes each number's median
   (``autopar.runtime.calibrate.calibrate_local(2)``: 1-thread fp32 linear-layer and
   attention rates with their half-performance lengths, per-node dispatch and checkpointing
   overheads, copy bandwidth, the Adam step, gloo all-reduce alpha/beta, the all-gather's
   alpha and the all-reduce's overlap with compute) and uses it as the cluster
   (``--save-cluster`` writes it as JSON; ``--cluster`` loads one instead of calibrating, to
   re-run the same predictions);
2. plans each layout with ``autopar.plan(..., layout=...)`` (the Megatron-placement TP
   variant re-priced with ``autopar.api.evaluate_plan``), priced in fp32 as executed and,
   for comparison, in bf16 mixed precision as on GPUs;
3. runs every plan with ``autopar.parallelize`` in 2 spawned processes (one torch thread
   each), 3 programs per layout (each with its own process groups: two programs of one
   plan built in one process measured up to 11% apart over the same 21 rounds, mostly in
   the time their collectives took), AdamW, 2 warm-up rounds, then 21 timed rounds of one
   ``train_step`` of every program in turn; a layout's step in a round is the mean over its
   programs of the slowest rank's step, and its measured step the median over rounds (the
   spread of its programs' own medians is printed beside it);
4. prints layout, predicted, measured, error and whether the predicted ranking of the
   layouts equals the measured one (median step per layout), then every pair of layouts:
   predicted and measured ratio (per round, so a slow spell of the host cancels), how many
   rounds the predicted-faster one won and the sign test's p-value, and whether the
   predicted order holds on the pairs the measurement tells apart. Two layouts a few per
   cent apart swap places between runs on a shared 2-core VM; the sign test says which
   measured orders are more than that. A benchmark: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import time
from pathlib import Path

import torch

import autopar
from autopar.planner.strategies.megatron import megatron_placements
from autopar.graph.capture import trace_model
from autopar.api import evaluate_plan
from autopar.runtime.calibrate import calibrate_local
from autopar.runtime.launch import launch
from autopar.models import GPT, GPTConfig
from cost_models.hardware import Cluster

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=64)
BATCH, SEQ, WARMUP, TIMED = 16, 64, 2, 21
PROGRAMS = 3  # programs built per layout, each with its own process groups
SIGNIFICANCE = 0.05  # a pair of layouts is told apart when the sign test's p-value is below this
CALIBRATIONS = 3  # the cluster is the median of this many calibrations
# name -> (tp, pp, dp, micro_batch_size, recompute, placements: "solver" (its placements and
# sequence parallelism) | "megatron" (Megatron's pattern, no sequence parallelism))
LAYOUTS = {
    "dp2 mbs8": (1, 1, 2, 8, "none", "solver"),
    "tp2 mbs16 (solver placements)": (2, 1, 1, 16, "none", "solver"),
    "tp2 mbs16 (Megatron placements)": (2, 1, 1, 16, "none", "megatron"),
    "pp2 mbs4 1f1b": (1, 2, 1, 4, "none", "solver"),
    "pp2 mbs2 1f1b recompute=full": (1, 2, 1, 2, "full", "solver"),
}


def _meta() -> GPT:
    with torch.device("meta"):
        return GPT(CONFIG)


def make_plans(cluster: Cluster) -> dict[str, autopar.Plan]:
    """One executable (fp32) plan per layout, with the cost model's prediction."""
    plans = {}
    for name, (tp, pp, dp, mbs, recompute, kind) in LAYOUTS.items():
        layout = autopar.Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, recompute=recompute,
                                sequence_parallel=False if kind == "megatron" else None)
        plan = autopar.plan(_meta(), cluster, global_batch_size=BATCH, seq_len=SEQ, layout=layout)
        if kind == "megatron":
            placements = megatron_placements(trace_model(_meta(), SEQ), tp,
                                             sequence_parallel=plan.sequence_parallel)
            plan = evaluate_plan(_meta(), cluster, dataclasses.replace(plan, placements=placements))
        plans[name] = plan
    return plans


def _measure(rank: int, world: int, plans: dict) -> dict[str, list[list[float]]]:
    """Per layout, per program built for it (``PROGRAMS``), the slowest rank's train_step
    (s) in each timed round. Every program is built first, each with its own process
    groups; each round then runs one step of every program in turn, so that a slow spell
    of the shared host falls on all layouts alike."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g),
             torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g))
    programs = []
    for copy in range(PROGRAMS):
        for name, plan in plans.items():
            torch.manual_seed(0)
            programs.append((name, copy, autopar.parallelize(
                GPT(CONFIG), plan=plan, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))))
    times = {name: [[] for _ in range(PROGRAMS)] for name in plans}
    for step in range(WARMUP + TIMED):
        for name, copy, pm in programs:
            dist.barrier()
            t0 = time.perf_counter()
            pm.train_step(*batch)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= WARMUP:
                times[name][copy].append(dt.item())
    return times


def per_round(times: list[list[float]]) -> list[float]:
    """A layout's step in each round: the mean over its programs (``times[program][round]``)."""
    return [statistics.fmean(steps) for steps in zip(*times)]


def sign_test_p(wins: int, rounds: int) -> float:
    """Two-sided p-value of ``wins`` out of ``rounds`` under a fair coin (the exact binomial
    sign test; Conover, *Practical Nonparametric Statistics*, 3rd ed., section 3.4)."""
    tail = sum(math.comb(rounds, k) for k in range(min(wins, rounds - wins) + 1)) / 2**rounds
    return min(1.0, 2 * tail)


def paired_order(predicted: dict[str, float], rounds: dict[str, list[float]]) -> list[tuple]:
    """For every pair (a, b) of layouts with a predicted faster than b: (a, b, predicted
    ratio a/b, median over rounds of the measured ratio a/b, rounds in which a was faster,
    sign-test p-value). The layouts of one round run back to back, so the per-round ratio
    cancels the host's slow spells that move every layout's median alike."""
    out = []
    names = sorted(predicted, key=predicted.get)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ratios = [x / y for x, y in zip(rounds[a], rounds[b])]
            wins = sum(r < 1 for r in ratios)
            out.append((a, b, predicted[a] / predicted[b], statistics.median(ratios), wins,
                        sign_test_p(wins, len(ratios))))
    return out


def _ranking(times: dict[str, float]) -> list[str]:
    return sorted(times, key=times.get)


def median_profile(profiles: list[dict]) -> dict:
    """The cluster profile whose every measured number is the median of ``profiles``' (the
    same keys; sources and notes from the first). One calibration's terms vary by 10-40%
    between runs on a shared 2-core VM; the median of three steadies them."""
    def merge(items):
        first = items[0]
        if isinstance(first, dict) and type(first.get("value")) in (int, float):
            return {**first, "value": statistics.median(i["value"] for i in items)}
        if isinstance(first, dict):
            return {k: first[k] if k == "notes" else merge([i[k] for i in items]) for k in first}
        return first
    return merge(profiles)


def placement_differences(a: autopar.Plan, b: autopar.Plan) -> list[str]:
    """Where ``a``'s placements differ from ``b``'s, one entry per node name with its layer
    index ("h_*") and fx's numbering suffix ("transpose_3" -> "transpose") taken out, as
    "node: a's vs b's"."""
    out = {}
    for node, place in a.placements.items():
        if b.placements.get(node) != place:
            name = re.sub(r"_\d+$", "", re.sub(r"_h_\d+_", "_h_*_", node))
            out.setdefault((name, place), f"{name}: {place} vs {b.placements.get(node)}")
    return list(out.values())


def main(save_cluster: str | None = None, cluster_path: str | None = None) -> None:
    start = time.perf_counter()
    if cluster_path:
        profile = json.loads(Path(cluster_path).read_text(encoding="utf-8"))
    else:
        profile = median_profile([calibrate_local(2) for _ in range(CALIBRATIONS)])
    if save_cluster:
        Path(save_cluster).write_text(json.dumps(profile, indent=1) + "\n", encoding="utf-8")
    cluster = Cluster.from_dict(profile)
    dev, link = cluster.device, cluster.intra_node
    how = f"loaded {cluster_path}" if cluster_path else f"calibrated {CALIBRATIONS} times"
    print(f"{how} in {time.perf_counter() - start:.1f} s, medians: "
          f"{dev.peak_tflops * 1e3:.1f} GFLOP/s "
          f"fp32 linear-layer GEMMs per rank (n½ {dev.gemm_half_dim:.0f} of the smallest "
          f"dimension), attention {dev.attention_tflops * 1e3:.1f} GFLOP/s (n½ "
          f"{dev.attention_half_dim:.0f} of min(s, hd)), "
          f"{dev.memory_bandwidth_gbps:.1f} GB/s copy, gloo alpha {link.latency_s * 1e6:.0f} us "
          f"(all-gather {(link.all_gather_latency_s or link.latency_s) * 1e6:.0f} us), "
          f"bus bandwidth {link.bandwidth_gbps:.2f} GB/s, overlap {dev.comm_overlap:.2f}; "
          f"per graph node {dev.op_overhead_s * 1e6:.1f} us dispatch (x3 forward + backward), "
          f"{dev.recompute_overhead_s * 1e6:.1f} us checkpointing; Adam "
          f"{dev.optimizer_bytes_per_param:.0f} B/param")
    plans = make_plans(cluster)
    solver, megatron = (plans[f"tp2 mbs16 ({k} placements)"] for k in ("solver", "Megatron"))
    print(f"solver's tp2 plan (sequence_parallel={solver.sequence_parallel}) against Megatron's "
          "placements, per node (solver's vs Megatron's):\n  " + "\n  ".join(
              placement_differences(solver, megatron) or ["the same placements"]))
    bf16 = {n: evaluate_plan(_meta(), cluster, dataclasses.replace(p, dtype="bf16"))
            for n, p in plans.items()}
    load = os.getloadavg()[0]
    by_program = launch(_measure, 2, plans, timeout_s=900, pg_timeout_s=600)[0]
    rounds = {n: per_round(t) for n, t in by_program.items()}
    measured = {n: statistics.median(t) for n, t in rounds.items()}
    program_medians = {n: [statistics.median(steps) for steps in t] for n, t in by_program.items()}
    predicted = {n: p.predicted.step_time_s for n, p in plans.items()}
    print(f"\nGPT L={CONFIG.n_layer} h={CONFIG.n_embd} a={CONFIG.n_head} V={CONFIG.vocab_size}, "
          f"global batch {BATCH}, seq {SEQ}, world 2, AdamW; {PROGRAMS} programs per layout; "
          f"median of {TIMED} rounds (a step of every program in turn; a layout's step is the "
          f"mean of its programs') after {WARMUP} warm-up; host load average {load:.2f} on "
          f"{os.cpu_count()} CPUs before the run (other work shares the cores the ranks use)\n")
    print("| layout | predicted fp32 (s) | measured (s) | error | its programs' medians (s) "
          "| predicted bf16 (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in plans:
        err = (predicted[n] - measured[n]) / measured[n]
        print(f"| {n} | {predicted[n]:.4f} | {measured[n]:.4f} | {err:+.1%} | "
              f"{min(program_medians[n]):.4f}..{max(program_medians[n]):.4f} | "
              f"{bf16[n].predicted.step_time_s:.4f} |")
    ranks_p, ranks_m = _ranking(predicted), _ranking(measured)
    print(f"\npredicted ranking: {ranks_p}\nmeasured ranking:  {ranks_m}")
    print(f"rankings equal: {ranks_p == ranks_m}")
    print(f"\npairs, predicted faster first; measured ratio = median over the {TIMED} rounds of "
          "the per-round ratio; told apart when the sign test's p < "
          f"{SIGNIFICANCE}:\n\n| faster (predicted) | slower (predicted) | predicted ratio | "
          "measured ratio | rounds faster | p | verdict |\n|---|---|---:|---:|---:|---:|---|")
    disagree = 0
    for a, b, ratio_p, ratio_m, wins, p in paired_order(predicted, rounds):
        apart = p < SIGNIFICANCE
        verdict = ("agrees" if ratio_m < 1 else "DISAGREES") if apart else "not told apart"
        disagree += apart and ratio_m >= 1
        print(f"| {a} | {b} | {ratio_p:.3f} | {ratio_m:.3f} | {wins}/{TIMED} | {p:.3g} | "
              f"{verdict} |")
    print(f"predicted order on every pair the measurement tells apart: "
          f"{'agrees' if not disagree else f'{disagree} pair(s) disagree'}")
    gap = statistics.median(bf16[n].predicted.step_time_s / predicted[n] for n in plans)
    print(f"bf16 mixed-precision pricing of the same plans is {gap:.2f}x the fp32 pricing "
          "(median); the CPU run executes fp32, which the fp32 column prices")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-cluster", metavar="PATH", help="write the calibrated cluster JSON")
    parser.add_argument("--cluster", metavar="PATH", help="a cluster JSON instead of calibrating")
    args = parser.parse_args()
    main(args.save_cluster, args.cluster)
