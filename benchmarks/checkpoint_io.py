"""What whole-or-absent checkpoints cost: the SHA-256 manifest of a save and the check of a
load, against the save and the load themselves, for a model of a few hundred MB.

    python benchmarks/checkpoint_io.py [--layers 6] [--hidden 512] [--vocab 32000] [--world 2]

Launches ``--world`` local gloo ranks (dp = world, ZeRO-1, AdamW: the checkpoint holds the
fp32 parameters and both Adam moments, 12 bytes per parameter), takes one step, then times
on every rank (median of 3, rank 0 printed):

* ``save``: ``save_checkpoint`` into a directory that already holds a checkpoint (staging,
  DCP's write, the manifest, the rename);
* ``manifest``: the hashing part of it alone (``verify_checkpoint`` of the result over the
  checkpoint group hashes the same files split over the ranks the same way);
* ``load``: ``load_checkpoint`` (the check against the manifest included);
* the checkpoint's bytes and the hashing rate.

A benchmark: it prints figures, it asserts nothing. Files are written under a temporary
directory (page cache warm: the rates are the CPU's, not the disk's).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.runtime.checkpoint_files import verify_checkpoint  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from cost_models.hardware import Cluster  # noqa: E402

REPEATS = 3


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _worker(rank: int, world: int, config: GPTConfig, plan_json: str, directory: str) -> dict:
    torch.manual_seed(0)
    pm = autopar.parallelize(GPT(config), plan=autopar.Plan.from_json(plan_json),
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    idx = torch.randint(0, config.vocab_size, (world * 2, 16))
    pm.train_step(idx, idx)
    path = Path(directory) / "latest"
    pm.save_checkpoint(path)  # so that every timed save replaces one
    group = pm.groups.checkpoint_group
    times = {"save": [], "manifest": [], "load": []}
    for _ in range(REPEATS):
        times["save"].append(_timed(lambda: pm.save_checkpoint(path)))
        times["manifest"].append(_timed(lambda: verify_checkpoint(path, group)))
        times["load"].append(_timed(lambda: pm.load_checkpoint(path)))
    size = sum(p.stat().st_size for p in path.iterdir())
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "bytes": size}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    config = GPTConfig(n_layer=args.layers, n_head=8, n_embd=args.hidden,
                       vocab_size=args.vocab, block_size=16)
    with torch.device("meta"):
        meta = GPT(config)
    params = sum(p.numel() for p in meta.parameters())
    plan = autopar.plan(meta, Cluster.local_cpu(processes=args.world),
                        global_batch_size=args.world * 2, seq_len=16,
                        layout=autopar.Layout(tp=1, pp=1, dp=args.world, zero_stage=1,
                                              micro_batch_size=2, recompute="none",
                                              dtype="fp32"))
    with tempfile.TemporaryDirectory() as directory:
        out = launch(_worker, args.world, config, plan.to_json(), directory, timeout_s=1200)[0]
    t, size = out["median_s"], out["bytes"]
    print(f"GPT {args.layers} layers, h {args.hidden}, V {args.vocab}: {params / 1e6:.1f}M "
          f"parameters; checkpoint {size / 1e6:.0f} MB (fp32 parameters + AdamW moments); "
          f"{args.world} ranks, dp={args.world} ZeRO-1; median of {REPEATS}")
    print(f"  save (staging, DCP write, manifest, rename)  {t['save']:7.3f} s")
    print(f"  of which the manifest's SHA-256 (alone)      {t['manifest']:7.3f} s  "
          f"({t['manifest'] / t['save']:.0%} of the save; {size / t['manifest'] / 1e9:.2f} GB/s "
          f"over {args.world} ranks)")
    print(f"  load (manifest check included)               {t['load']:7.3f} s  "
          f"(the check is {t['manifest'] / t['load']:.0%} of it)")


if __name__ == "__main__":
    main()
