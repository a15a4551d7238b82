"""Peak memory of shard-only initialisation: each rank's torch CPU allocations while it
parallelizes a GPT built on the meta device and trains one step, against the plan's
predicted model-state bytes for its stage and the whole model's fp32 bytes.

    python benchmarks/shard_init_memory.py [--layers 4] [--hidden 256] [--vocab 8192]

For each layout (tp=2; dp=2 ZeRO-3; tp=2·pp=2; tp=4) it launches the ranks on local gloo
processes (:func:`autopar.runtime.launch.launch`); every rank builds the meta GPT, then
runs ``autopar.parallelize``, then one AdamW ``train_step``, each inside a
:class:`~autopar.runtime.stats.PeakAllocation` (the CPU allocator's bytes held at the
highest point, tensors allocated inside the region only). It prints per rank: the peak of
parallelize (the shard-only initialisation: shards plus one module whole, or the
optimizer's flat copy of the shards), the peak of parallelize + the step (what parallelize
left held plus the step's peak), the model states the step held
(``last_step_stats()["model_state_bytes"]``), the plan's prediction for the rank's stage
(``plan.predicted.stage_stats[pp_rank]["model_state_bytes"]``, Adam's 16 bytes per fp32
parameter: more than the whole model's 4 bytes per parameter once sharded over 4 or
fewer ranks), and both peaks as fractions of the whole model's fp32 parameter bytes.
Below the table, the peak when one rank builds the model materialised instead
(``GPT(config)`` on the CPU, before any sharding). A benchmark: it prints figures, it
asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from autopar.runtime.stats import PeakAllocation  # noqa: E402
from cost_models.hardware import Cluster  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2, pp=1, dp=1), "dp2 zero3": dict(tp=1, pp=1, dp=2, zero_stage=3),
           "tp2·pp2": dict(tp=2, pp=2, dp=1), "tp4": dict(tp=4, pp=1, dp=1)}
BATCH, SEQ = 4, 64
MIB = 2 ** 20


def config(layers: int = 4, hidden: int = 256, vocab: int = 8192) -> GPTConfig:
    """The benchmark GPT: the embedding and the MLPs hold most of its weights."""
    return GPTConfig(n_layer=layers, n_head=8, n_embd=hidden, vocab_size=vocab, block_size=SEQ)


def meta_gpt(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def fp32_bytes(cfg: GPTConfig) -> int:
    """The whole model's fp32 parameter bytes (the tied lm_head counted once)."""
    return 4 * sum(p.numel() for p in meta_gpt(cfg).parameters())


def make_plan(cfg: GPTConfig, layout: dict) -> autopar.Plan:
    """The solver's fp32 plan of ``cfg`` for ``layout`` on this machine's CPU profile."""
    world = layout["tp"] * layout["pp"] * layout["dp"]
    mbs = 1 if layout["pp"] > 1 else 2
    return autopar.plan(meta_gpt(cfg), Cluster.local_cpu(processes=world), global_batch_size=BATCH,
                        seq_len=SEQ, layout=autopar.Layout(micro_batch_size=mbs, **layout))


def measure_rank(rank: int, world: int, cfg: GPTConfig, plan: autopar.Plan, optimizer) -> dict:
    """One rank: parallelize the meta GPT, then train one step, each inside a
    PeakAllocation; returns its pipeline rank, the peak bytes of parallelize and of both
    (what parallelize left held plus the step's peak), measured and predicted model-state
    bytes."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    meta = meta_gpt(cfg)
    with PeakAllocation() as build:
        pm = autopar.parallelize(meta, plan=plan, optimizer=optimizer, seed=0)
    with PeakAllocation() as step:
        loss = pm.train_step(idx, torch.roll(idx, -1, dims=1))
    stage = pm.groups.pp_rank
    return {"rank": rank, "pp_rank": stage, "build_bytes": build.peak_bytes, "loss": loss,
            "peak_bytes": max(build.peak_bytes, build.end_bytes + step.peak_bytes),
            "model_state_bytes": pm.last_step_stats()["model_state_bytes"],
            "predicted_bytes": plan.predicted.stage_stats[stage]["model_state_bytes"]}


def materialised_peak(cfg: GPTConfig) -> int:
    """Peak bytes of building ``cfg``'s GPT on the CPU in this process (the whole model)."""
    with PeakAllocation() as peak:
        GPT(cfg)
    return peak.peak_bytes


def run(cfg: GPTConfig, layouts: dict = LAYOUTS, optimizer=None) -> dict[str, list[dict]]:
    """Every layout's per-rank measurements (launches tp·pp·dp processes per layout)."""
    optimizer = optimizer or functools.partial(torch.optim.AdamW, lr=1e-3)
    out = {}
    for name, layout in layouts.items():
        plan = make_plan(cfg, layout)
        out[name] = launch(measure_rank, plan.num_gpus, cfg, plan, optimizer, timeout_s=300)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args(argv)
    cfg = config(args.layers, args.hidden, args.vocab)
    whole = fp32_bytes(cfg)
    largest = max(4 * sum(p.numel() for p in m.parameters(recurse=False))
                  for m in meta_gpt(cfg).modules())
    print(f"GPT L={cfg.n_layer} h={cfg.n_embd} V={cfg.vocab_size} s={SEQ}: "
          f"{whole / 4:,.0f} parameters, {whole / MIB:.1f} MiB in fp32, the largest module "
          f"(the embedding) {largest / MIB:.1f} MiB; AdamW, B={BATCH}")
    print(f"{'layout':<10} {'rank':>4} {'stage':>5} {'parallelize MiB':>15} {'+ step MiB':>10} "
          f"{'states MiB':>10} {'predicted MiB':>13} {'parallelize/whole':>17} {'peak/whole':>10}")
    for name, ranks in run(cfg).items():
        for r in ranks:
            print(f"{name:<10} {r['rank']:>4} {r['pp_rank']:>5} {r['build_bytes'] / MIB:>15.1f} "
                  f"{r['peak_bytes'] / MIB:>10.1f} {r['model_state_bytes'] / MIB:>10.1f} "
                  f"{r['predicted_bytes'] / MIB:>13.1f} {r['build_bytes'] / whole:>17.2f} "
                  f"{r['peak_bytes'] / whole:>10.2f}")
    print(f"building the model materialised on one rank instead: peak "
          f"{materialised_peak(cfg) / MIB:.1f} MiB ({materialised_peak(cfg) / whole:.2f} of the whole)")


if __name__ == "__main__":
    main()
