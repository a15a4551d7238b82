"""Saved activations of each pipeline schedule, measured against autopar's prediction.

    python benchmarks/split_backward_memory.py [--micro-batches 4,8] [--pp 2]

Trains a 4-layer GPT (h 32, s 16, 8 sequences per step) on pp gloo processes (default 2) under
each pipeline schedule, pinned, and prints per pipeline rank the last step's measured
saved-activation bytes (``last_step_stats()["saved_activation_bytes"]``) over the plan's
prediction (``predicted.stage_stats[rank]["saved_activation_bytes"]``). The split-backward
schedules (ZB-H1, ZB-V, DualPipeV) are priced as torch holds them: each micro-batch's graph
from its forward to its weight-gradient pass (``order_in_flight``); README gives the
figures.
"""

from __future__ import annotations

import argparse

import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.launch import launch

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=64, block_size=16)
BATCH, SEQ, STEPS = 8, 16, 3
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2))


def _worker(rank: int, world: int, text: str) -> tuple[float, float]:
    """(measured, predicted) saved-activation bytes of this rank's last of STEPS steps."""
    plan = autopar.Plan.from_json(text)
    torch.manual_seed(0)
    pm = autopar.parallelize(GPT(CONFIG), plan=plan, measure_every=1,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        idx = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g)
        pm.train_step(idx, torch.roll(idx, -1, dims=1))
    predicted = plan.predicted.stage_stats[pm.groups.pp_rank]["saved_activation_bytes"]
    return float(pm.last_step_stats()["saved_activation_bytes"]), float(predicted)


def main(argv: list[str] | None = None) -> None:
    """Print one row per (schedule, m): measured / predicted saved bytes on each rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", default="4,8", help="m values, comma-separated")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    args = parser.parse_args(argv)
    with torch.device("meta"):
        meta = GPT(CONFIG)
    cluster = autopar.Cluster.local_cpu(processes=args.pp)
    print("| schedule | m | " + " | ".join(f"rank {i} measured / predicted"
                                         for i in range(args.pp)) + " |")
    print("|---|---:|" + "---:|" * args.pp)
    for m in (int(x) for x in args.micro_batches.split(",")):
        for schedule, v in SCHEDULES:
            layout = autopar.Layout(tp=1, pp=args.pp, dp=1, micro_batch_size=BATCH // m,
                                    schedule=schedule, virtual_stages=v, recompute="none")
            try:
                plan = autopar.plan(meta, cluster, global_batch_size=BATCH, seq_len=SEQ,
                                    layout=layout)
            except ValueError as exc:  # the schedule's rule, e.g. DualPipeV's m >= 2p
                print(f"| {schedule} | {m} | {exc} | |")
                continue
            rows = launch(_worker, args.pp, plan.to_json(), timeout_s=300)
            cells = " | ".join(f"{got / want:.3f} ({got:,.0f} / {want:,.0f} B)"
                               for got, want in rows)
            print(f"| {schedule} | {m} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
