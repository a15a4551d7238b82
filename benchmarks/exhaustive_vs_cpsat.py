"""CP-SAT search vs the exhaustive check of the same plan space, case by case.

    python benchmarks/exhaustive_vs_cpsat.py [--quick] [--match TEXT ...]

For each case (a small GPT on a cluster of N <= 64, some with device memory shrunk so that
recompute, pipelining or ZeRO must be used) prints the wall time of ``autopar``'s search
(CP-SAT per config, bound-pruned) and of ``autopar.oracle.exhaustive`` (every config, every plan),
both predicted step times, the gap, and the optimum when memory is checked with predict's
exact bytes instead of the solver's rounded KiB (a plan the solver's rounding rejects but
that predict says fits shows up as a negative "rounding" column). Rows whose gap exceeds
0.1% list both layouts, and the exit status is then 1 (also when one side finds a plan and
the other does not: a gap that is not a number fails too). ``--match`` runs only the cases
whose label contains one of the given texts (e.g. ``--match GiB ZeRO`` for the memory-tight and
ZeRO cases), so a long run can be split over several sessions.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch

import autopar
from autopar.api import plan_from_search
from autopar.oracle.exhaustive import exhaustive_search
from autopar.models import GPT, GPTConfig
from autopar.contract.support import RUNTIME_SUPPORT, RuntimeSupport
from autopar.planner.search import search
from autopar.planner.costs.decision import InfeasibleError
from autopar.graph.capture import trace_model
from cost_models.hardware import Cluster
from cost_models.reserve import MemoryReserve

ZERO = RuntimeSupport(zero_stages=(0, 1, 2, 3))
MAX_GAP = 1e-3  # CP-SAT's step time may exceed the exhaustive optimum by at most 0.1%


def _memory(cluster: Cluster, gib: float | None) -> Cluster:
    if gib is None:
        return cluster
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_gib=gib),
                               memory_reserve=MemoryReserve.none())  # KiB-sized memories


def cases(quick: bool) -> list[tuple]:
    """(label, GPTConfig, cluster, global batch, seq_len, support)."""
    models = [GPTConfig(2, 4, 64, 256, 64), GPTConfig(4, 8, 256, 512, 128),
              GPTConfig(6, 8, 512, 1024, 128), GPTConfig(8, 16, 1024, 1024, 256)]
    clusters = [Cluster.local_cpu(2), Cluster.local_cpu(8), Cluster.dgx_a100(1), Cluster.dgx_a100(2)]
    if not quick:
        clusters += [Cluster.local_cpu(4), Cluster.dgx_a100(4), Cluster.dgx_a100(8)]
    out = [(f"L{m.n_layer} h{m.n_embd} {c.name} N={c.num_gpus}", m, c, 16 if c.num_gpus <= 16 else 64,
            m.block_size, RUNTIME_SUPPORT) for m in models for c in clusters]
    tight = [(GPTConfig(4, 8, 256, 512, 256), Cluster.local_cpu(4), 0.02),
             (GPTConfig(4, 8, 256, 512, 256), Cluster.dgx_a100(1), 0.02),
             (GPTConfig(8, 16, 1024, 1024, 512), Cluster.dgx_a100(1), 0.35),
             (GPTConfig(8, 16, 1024, 1024, 512), Cluster.dgx_a100(1), 0.6)]
    for m, c, gib in tight:
        for support, tag in ((RUNTIME_SUPPORT, ""), (ZERO, " ZeRO0-3")):
            out.append((f"L{m.n_layer} h{m.n_embd} {c.name} N={c.num_gpus} {gib} GiB{tag}", m,
                        _memory(c, gib), 16, m.block_size, support))
    for m in models[1:]:
        out.append((f"L{m.n_layer} h{m.n_embd} dgx-a100 N=8 ZeRO0-3", m, Cluster.dgx_a100(1), 16,
                    m.block_size, ZERO))
    return out


def _cpsat(traced, model, cluster, batch, seq, support):
    start = time.perf_counter()
    try:
        result = search(traced, cluster, batch, autopar.Layout(), support)
    except InfeasibleError:
        return None, time.perf_counter() - start
    plan = plan_from_search(traced, model, cluster, result, global_batch_size=batch, seq_len=seq,
                            model_name="gpt")
    return plan, time.perf_counter() - start


def _layout(d) -> str:
    c = d.config
    return (f"tp{c.tp} pp{c.pp} dp{c.dp} mbs{c.micro_batch_size} zero{d.zero_stage} "
            f"stages {[hi - lo for lo, hi in d.stage_layers]} recompute "
            f"{'/'.join(f'{d.recompute.count(r)}{r[0]}' for r in ('full', 'selective'))}")


def gap(cpsat_s: float | None, optimum_s: float | None) -> float:
    """CP-SAT's predicted step over the exhaustive optimum, minus 1; 0 when neither finds a
    plan, inf when only the exhaustive search does, -inf when only CP-SAT does (a plan the
    oracle says does not exist), NaN for a non-finite step time (never a silent pass)."""
    if cpsat_s is None and optimum_s is None:
        return 0.0
    if optimum_s is None:
        return -math.inf
    if cpsat_s is None:
        return math.inf
    return cpsat_s / optimum_s - 1


def failed(gaps: list[float]) -> bool:
    """Any gap above :data:`MAX_GAP`, or not a number, or an oracle without a plan that
    CP-SAT found (negative infinity)."""
    return any(not (-1e-9 <= g <= MAX_GAP) for g in gaps)


def main(quick: bool, match: list[str] | None = None) -> int:
    print("| case | CP-SAT s | exhaustive s | plans covered | CP-SAT step | exhaustive step | gap "
          "| exact-memory optimum vs exhaustive |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    worst, notes, gaps = 0.0, [], []
    selected = [c for c in cases(quick) if not match or any(t in c[0] for t in match)]
    for label, cfg, cluster, batch, seq, support in selected:
        with torch.device("meta"):
            model = GPT(cfg)
        traced = trace_model(model, seq)
        plan, cp_s = _cpsat(traced, model, cluster, batch, seq, support)
        start = time.perf_counter()
        best = exhaustive_search(traced, cluster, batch, support=support, rounding="solver")
        ex_s = time.perf_counter() - start
        exact = exhaustive_search(traced, cluster, batch, support=support, rounding="predict")
        cp_t = plan.predicted.step_time_s if plan else float("inf")
        g = gap(plan.predicted.step_time_s if plan else None,
                best.step_time_s if best.decision else None)
        gaps.append(g)
        rounding = exact.step_time_s / best.step_time_s - 1 if best.decision else float("nan")
        worst = max(worst, g) if g == g else float("nan")
        print(f"| {label} | {cp_s:.2f} | {ex_s:.2f} | {best.plans_covered:,} | {cp_t:.4e} | "
              f"{best.step_time_s:.4e} | {g:+.3%} | {rounding:+.3%} |")
        if failed([g]) and plan and best.decision:
            notes.append(f"{label}: CP-SAT {plan.tp}/{plan.pp}/{plan.dp} mbs{plan.micro_batch_size} "
                         f"zero{plan.zero_stage} vs exhaustive {_layout(best.decision)}")
        sys.stdout.flush()
    print(f"\nworst CP-SAT gap: {worst:+.3%} (limit {MAX_GAP:+.1%})")
    for note in notes:
        print(" -", note)
    bad = [label for (label, *_), g in zip(selected, gaps) if failed([g])]
    if bad:
        print(f"FAIL: {len(bad)} case(s) beyond the limit: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the clusters of the slow test only")
    parser.add_argument("--match", nargs="+", metavar="TEXT",
                        help="run only the cases whose label contains one of these texts")
    args = parser.parse_args()
    sys.exit(main(args.quick, args.match))
