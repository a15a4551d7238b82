"""Planning speed and exactness for big models: Llama-3-70B- and GPT-3-175B-shaped, on 64
and 1024 A100s, captured and planned in one process on the meta device.

    python benchmarks/plan_large.py [--models gpt3-175b llama3-70b] [--nodes 8 128]

For each model and cluster (DGX A100 nodes of 8 GPUs) it times the capture
(``trace_model``: fx for autopar's GPT, torch.export for the Hugging Face Llama) and the
search (``autopar.plan`` without its capture), prints the plan, and checks

* wall time of capture + plan under 15 s;
* the plan's predicted FLOPs (model FLOPs behind MFU; hardware FLOPs behind TFLOP/s, with
  the recomputed forwards) equal the closed forms of :mod:`autopar.oracle.plan_forms`;
* its predicted memory per GPU, each pipeline rank and kind, equals the closed form when
  the plan's TP placements are Megatron's hand pattern without sequence parallelism (the
  plan re-priced with :func:`~autopar.planner.strategies.megatron.megatron_placements`, SP off: the
  closed forms are Korthikanti's tensor-parallel rows). The solver's own
  placements differ from that pattern where it is free to (which element-wise ops run on
  which shards): its prediction is printed beside it with the nodes that differ.

It also lists the tensors of the chosen plan that are produced sharded and all-gathered
for a consumer that keeps its input for backward (a replicated LayerNorm, a column-split
Linear): the runtime keeps the gathered tensor whole (measured with
``SavedActivationTracker`` on 2 gloo ranks), and the cost model prices it so
(:attr:`~autopar.planner.costs.tables.EdgeCost.saved_bytes`, in the solver's memory rows).

Batches: GPT-3 at s = 2048, B = 1536 (Brown et al. 2020; Narayanan et al. 2021, Table 1);
Llama-3-70B at s = 8192, B = 512, 4.2M tokens per step (Llama 3 pre-training used 4M
rising to 16M, Dubey et al. 2024, section 3.4). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.api import plan_from_search  # noqa: E402
from autopar.graph.annotate import saves_inputs  # noqa: E402
from autopar.graph.capture import trace_model  # noqa: E402
from autopar.models import GPT, preset  # noqa: E402
from autopar.oracle.plan_forms import (ModelShape, predicted_flops, stage_memory_bytes,  # noqa: E402
                                       step_flops)
from autopar.planner.strategies.megatron import megatron_placements  # noqa: E402
from autopar.planner.costs.decision import decision_from_plan  # noqa: E402
from autopar.planner.costs.predict import predict  # noqa: E402
from autopar.planner.search import search  # noqa: E402
from autopar.planner.strategies import decode_placements, tensor_inputs  # noqa: E402
from autopar.contract.support import RUNTIME_SUPPORT  # noqa: E402

TARGET_S = 15.0
REL_TOL = 1e-9  # "equal": the same sums in another order, float rounding only
NODES = (8, 128)
MEMORY_KINDS = ("parameters", "gradients", "optimizer_states", "activations")


def gpt3_175b() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(preset("gpt3-175b"))


def llama3_70b() -> torch.nn.Module:
    """Llama-3-70B's shape (Dubey et al. 2024, Table 3) as a transformers model on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


# name -> (builder, sequence length, global batch in sequences)
MODELS = {"gpt3-175b": (gpt3_175b, 2048, 1536), "llama3-70b": (llama3_70b, 8192, 512)}


@dataclass
class Case:
    """One planned model: the plan, the trace it was made on, and where the time went."""

    name: str
    model: torch.nn.Module
    cluster: autopar.Cluster
    traced: object
    plan: autopar.Plan
    capture_s: float
    plan_s: float

    @property
    def total_s(self) -> float:
        return self.capture_s + self.plan_s


def plan_case(name: str, nodes: int) -> Case:
    """Capture and plan ``name`` on ``nodes`` DGX A100 nodes, timing both halves."""
    build, seq, batch = MODELS[name]
    model, cluster = build(), autopar.Cluster.dgx_a100(nodes=nodes)
    start = time.perf_counter()
    traced = trace_model(model, seq, name=name)
    captured = time.perf_counter()
    result = search(traced, cluster, batch, autopar.Layout(), RUNTIME_SUPPORT)
    plan = plan_from_search(traced, model, cluster, result, global_batch_size=batch,
                            seq_len=seq, model_name=name)
    done = time.perf_counter()
    return Case(name, model, cluster, traced, plan, captured - start, done - captured)


def rel(a: float, b: float) -> float:
    """|a - b| / |b|; NaN or inf on either side is a failure (inf)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b else abs(a)


def flops_rows(case: Case) -> list[tuple[str, float, float]]:
    """(what, predicted, closed form) for model and hardware FLOPs of one step."""
    closed = step_flops(ModelShape.of(case.model), case.plan)
    pred = predicted_flops(case.plan, case.cluster.device.peak_flops)
    return [("model FLOPs", pred[0], closed[0]), ("hardware FLOPs", pred[1], closed[1])]


def reference_prediction(case: Case):
    """The plan's decisions re-priced with Megatron's placements instead of the solver's,
    without sequence parallelism (the closed forms' Korthikanti et al. 2022 Table 2 rows
    "tensor parallel", :mod:`autopar.oracle.plan_forms`) whether or not the plan uses it."""
    plan = case.plan
    ref = replace(plan, sequence_parallel=False,
                  placements=megatron_placements(case.traced, plan.tp, sequence_parallel=False))
    decision, tables, strategies = decision_from_plan(case.traced, case.cluster, ref)
    return predict(case.traced, strategies, tables, case.cluster, decision,
                   global_batch_size=plan.global_batch_size)


def memory_rows(case: Case) -> list[tuple[int, str, float, float, float]]:
    """(rank, kind, closed form, Megatron placements priced, the plan's own) in bytes."""
    closed = stage_memory_bytes(ModelShape.of(case.model), case.plan)
    ref = reference_prediction(case).memory_bytes_by_stage
    own = case.plan.predicted.memory_bytes_by_stage
    return [(i, k, closed[i][k], ref[i][k], own[i][k])
            for i in range(case.plan.pp) for k in MEMORY_KINDS]


def placement_differences(case: Case) -> list[str]:
    """Nodes of the template layer, the embedding and head sections whose solver placement
    differs from Megatron's, as "node: reference -> chosen"."""
    ref = megatron_placements(case.traced, case.plan.tp,
                              sequence_parallel=case.plan.sequence_parallel)
    names = case.traced.pre + case.traced.layers[0] + case.traced.post
    return [f"{n}: {ref[n]} -> {case.plan.placements[n]}" for n in names
            if ref[n] != case.plan.placements[n]]


def gathered_saves(case: Case) -> tuple[list[str], float]:
    """Template-layer tensors that the solver's placements produce sharded but that a
    consumer keeping its input for backward reads whole, through an all-gather. Returns
    their names and the bytes per layer and micro-batch that the whole copies add over the
    shards, 2·numel·b·(1 - 1/t) each: priced by the cost model (``EdgeCost.saved_bytes``)."""
    plan, traced = case.plan, case.traced
    chosen = {n: st for n, (_, st) in decode_placements(traced, plan.placements, plan.tp).items()}
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    names, extra = [], 0.0
    for u in traced.layers[0]:
        if not chosen[u].output.is_sharded:
            continue
        readers = [(v, j) for v in by_name[u].users if saves_inputs(traced.nodes[v.name])
                   for j, x in enumerate(tensor_inputs(v, traced.nodes)) if x is by_name[u]]
        if any(chosen[v.name].inputs[j].is_replicated for v, j in readers):
            names.append(u)
            extra += 2 * traced.nodes[u].numel * plan.micro_batch_size * (1 - 1 / plan.tp)
    return names, extra


def summary_row(case: Case) -> str:
    p, pred = case.plan, case.plan.predicted
    modes = ",".join(f"{m}×{p.recompute.count(m)}" for m in ("none", "selective", "full")
                     if m in p.recompute)
    flops = flops_rows(case)[0][1]
    return (f"| {case.name} | {p.num_gpus} | {case.capture_s:.1f} + {case.plan_s:.1f} = "
            f"{case.total_s:.1f} | {p.tp}/{p.pp}/{p.dp} | {p.micro_batch_size} | "
            f"{p.schedule} v={p.virtual_stages} | {modes} | {p.zero_stage} | "
            f"{pred.step_time_s:.2f} | {pred.peak_memory_bytes / 2**30:.1f} | "
            f"{flops / 1e18:.2f} | {pred.tflops_per_gpu:.0f} | {pred.mfu:.1%} |")


def check_case(case: Case) -> list[str]:
    """Print the checks of one case; return the failures."""
    failures = []
    if case.total_s >= TARGET_S:
        failures.append(f"{case.name} on {case.plan.num_gpus} GPUs: {case.total_s:.1f} s >= {TARGET_S} s")
    print(f"\n{case.name} on {case.plan.num_gpus} GPUs ({case.plan.summary()})")
    for what, pred, closed in flops_rows(case):
        err = rel(pred, closed)
        print(f"  {what}: predicted {pred:.6e}, closed form {closed:.6e}, rel. diff {err:.1e}")
        if err > REL_TOL:
            failures.append(f"{case.name}/{case.plan.num_gpus}: {what} {pred} != {closed}")
    rows = memory_rows(case)
    worst = max(rows, key=lambda r: rel(r[3], r[2]))
    print(f"  memory, {len(rows)} (rank, kind) pairs: Megatron placements priced vs closed "
          f"form, largest rel. diff {rel(worst[3], worst[2]):.1e} (rank {worst[0]} {worst[1]})")
    failures += [f"{case.name}/{case.plan.num_gpus}: rank {i} {k}: priced {r} != closed {c}"
                 for i, k, c, r, _ in rows if rel(r, c) > REL_TOL]
    peak_closed = max(sum(c for i2, _, c, _, _ in rows if i2 == i) for i in range(case.plan.pp))
    print(f"  peak memory per GPU: closed form (Megatron placements) {peak_closed / 2**30:.3f} GiB, "
          f"plan with the solver's placements {case.plan.predicted.peak_memory_bytes / 2**30:.3f} GiB")
    for kind in MEMORY_KINDS:
        own = [r[4] for r in rows if r[1] == kind]
        closed = [r[2] for r in rows if r[1] == kind]
        delta = max((o - c for o, c in zip(own, closed)), key=abs)
        print(f"    {kind:17s} solver − closed form, largest per rank: {delta / 2**30:+.3f} GiB")
    diffs = placement_differences(case)
    print(f"  the solver's placements differ from Megatron's at {len(diffs)} nodes of the "
          f"template layer and the embedding/head sections, e.g. {diffs[:6]}")
    names, extra = gathered_saves(case)
    print(f"  sharded tensors a saving consumer all-gathers (kept whole, priced whole): "
          f"{names or 'none'}, {extra / 2**20:.1f} MiB per layer and micro-batch")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--nodes", nargs="+", type=int, default=list(NODES))
    args = parser.parse_args(argv)
    cases = [plan_case(name, nodes) for name in args.models for nodes in args.nodes]
    print("| model | GPUs | capture + plan s | tp/pp/dp | mbs | schedule | recompute | ZeRO | "
          "step s | peak GiB/GPU | model EFLOP/step | TFLOP/s/GPU | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        print(summary_row(case))
    failures = [f for case in cases for f in check_case(case)]
    print("\nall checks passed" if not failures else "\nFAILED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
