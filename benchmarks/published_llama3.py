"""Llama 3 405B's published layouts (8K and 128K tokens) priced by autopar, beside its own plans.

    python benchmarks/published_llama3.py            # print, and write the report section
    python benchmarks/published_llama3.py --no-plan  # the published layouts only (~2 min)

Source: Grattafiori et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4 (the
three 405B pre-training configurations: GPUs, TP, CP, PP, DP, sequence length, batch size per
DP group, tokens per batch, TFLOP/s per GPU, BF16 MFU) and section 3.3.2 (the pipeline has
one layer fewer on its first and last stage; FSDP shards optimizer states and gradients and
keeps the parameters gathered after forward: priced as ZeRO-2; context parallelism by
all-gather of K and V, 2·cp load-balanced chunks). H100-SXM5-80GB, DGX H100 nodes.

The details the paper leaves open (the interleaved schedule's v, the micro-batch size,
activation recompute) are taken at the cost model's best among v in (1, 2, 4) (126 layers
over 16·v chunks, the first and last one layer fewer), micro-batch 1 (Table 4's batch per
DP group is then the micro-batch count) and recompute none, selective or full, among those
that fit the 80 GB; the table says which. ``autopar.plan`` then searches the same model,
cluster and batch with nothing pinned (cp included), each plan's wall time printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.hf_models import hf_factory  # noqa: E402
from cost_models.hardware import Cluster  # noqa: E402

REPORT = ROOT / "reports" / "published_vs_predicted.md"
BEGIN, END = "<!-- llama3-405b: begin -->", "<!-- llama3-405b: end -->"
L = 126
SOURCE = "arXiv:2407.21783, Table 4"
GAP = (
    "**Known gap (not within 15%).** The published layouts price 34-54% below Table 4, for "
    "three reasons the table shows: (1) the H100 profile's `matmul_efficiency` is a "
    "provisional placeholder (0.55, `cost_models/presets/dgx-h100.json`: no H100 row has "
    "been fitted), so every H100 row inherits its error; (2) the memory model fits none of "
    "the three layouts in 80 GB without full recompute (Hugging Face's Llama graph, "
    "micro-batch 1, ZeRO-2), while 38-43% MFU leaves no room for recomputing a 405B "
    "forward: autopar keeps more activations per layer than Meta's implementation did, or "
    "the run recomputed less than full layers in a way the paper does not state; (3) with "
    "16 micro-batches per DP group over 16 pipeline stages the interleaved schedule's "
    "bubble ((p-1)/(v.m), v <= 4 here) is 23-94% of the compute, where the published "
    "16,384-GPU rows lose only 7% to the 8,192-GPU one. The 128K row keeps its 8K rows' "
    "ratio better (context parallelism's all-gathers cost 0.4 s of a 30 s step). autopar's "
    "own 128K plan chooses CP 16 by itself, Table 4's layout, with 1F1B: it cannot "
    "interleave 126 layers over 16 stages (its runtime cuts p.v equal chunks), so at 128K "
    "the published layout priced with v = 4 is faster than autopar's plan, which the issue "
    "counts as a miss.")


@dataclass(frozen=True)
class Llama3Run:
    """One row of Table 4: GPUs, the layout, s, sequences per DP group and TFLOP/s per GPU."""

    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq_len: int
    per_dp: int
    published: float

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.per_dp


RUNS = (Llama3Run(8192, 8, 1, 16, 64, 8192, 32, 430.0),
        Llama3Run(16384, 8, 1, 16, 128, 8192, 16, 400.0),
        Llama3Run(16384, 8, 16, 16, 8, 131072, 16, 380.0))


def existing_section(path: Path = REPORT) -> str:
    """This script's section of the report as it stands ("" when none):
    ``published_runs.py`` keeps it when it rewrites the dense rows."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    return text[text.index(BEGIN):text.index(END) + len(END)] + "\n" if BEGIN in text else ""


def stage_layers(chunks: int) -> list[list[int]]:
    """126 layers over ``chunks`` model chunks as evenly as they go, the first and the last
    chunk one layer fewer where the split is uneven (section 3.3.2)."""
    base, extra = divmod(L, chunks)
    sizes = [base] * chunks
    for i in (list(range(1, chunks - 1)) + [0, chunks - 1])[:extra]:
        sizes[i] += 1
    out, lo = [], 0
    for size in sizes:
        out.append([lo, lo + size])
        lo += size
    return out


def published_plan(model, run: Llama3Run):
    """(the fastest priced variant that fits, else the fastest, whether it fits, variants)."""
    cluster = Cluster.dgx_h100(run.gpus // 8)
    variants = []
    for v in (1, 2, 4):
        for recompute in ("none", "selective", "full"):
            layout = autopar.Layout(
                tp=run.tp, cp=run.cp, pp=run.pp, dp=run.dp, micro_batch_size=1, zero_stage=2,
                sequence_parallel=True, recompute=recompute, virtual_stages=v,
                schedule="interleaved_1f1b" if v > 1 else "1f1b")
            plan = autopar.evaluate(model, cluster, layout, global_batch_size=run.global_batch_size,
                                    seq_len=run.seq_len, model_name="llama3-405b",
                                    stage_layers=stage_layers(run.pp * v), check_memory=False)
            variants.append(plan)
    fits = [p for p in variants if p.predicted.memory_margin_bytes >= 0]
    best = min(fits or variants, key=lambda p: p.predicted.step_time_s)
    return best, bool(fits), variants


def row(run: Llama3Run, plan, fits: bool) -> str:
    """One Markdown table row of the published layout as priced."""
    p = plan.predicted
    err = p.tflops_per_gpu / run.published - 1
    v = plan.virtual_stages
    how = f"v={v}, recompute={plan.recompute[0]}" + ("" if fits else ", does not fit 80 GB")
    return (f"| {run.gpus:,} | TP{run.tp} CP{run.cp} PP{run.pp} DP{run.dp} | {run.seq_len:,} | "
            f"{run.global_batch_size} | {how} | {run.published:.0f} | {p.tflops_per_gpu:.0f} | "
            f"{err:+.0%} | {p.step_time_s:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-plan", action="store_true", help="skip autopar's own plans")
    args = parser.parse_args()
    with torch.device("meta"):
        model = hf_factory("llama3-405b")()
    lines = ["| GPUs | published layout | s | B | details priced | published TFLOP/s | "
             "predicted | error | step s |", "| ---: | :--- | ---: | ---: | :--- | ---: | ---: "
             "| ---: | ---: |"]
    plans = []
    for run in RUNS:
        best, fits, _ = published_plan(model, run)
        lines.append(row(run, best, fits))
        print(lines[-1], flush=True)
        if not args.no_plan:
            start = time.perf_counter()
            auto = autopar.plan(model, Cluster.dgx_h100(run.gpus // 8),
                                global_batch_size=run.global_batch_size, seq_len=run.seq_len,
                                model_name="llama3-405b")
            wall = time.perf_counter() - start
            plans.append(f"- {run.gpus:,} GPUs, s = {run.seq_len:,}: `{auto.headline()}` "
                         f"({auto.solver.status}; planned in {wall:.0f} s on this machine)")
            print(plans[-1], flush=True)
    section = [BEGIN, "", "## Llama 3 405B (context parallelism)", "",
               f"Source: {SOURCE}; `python benchmarks/published_llama3.py` "
               "(module docstring: what is priced as published, what is autopar's choice).",
               "", *lines, "", *(["autopar's own plans, nothing pinned:", "", *plans, ""]
                                 if plans else []), GAP, "", END]
    text = REPORT.read_text()
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + "\n".join(section) + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n"
    REPORT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
