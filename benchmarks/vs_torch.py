"""A training step of autopar's program against torch's own at the same layout, world size 2.

    python benchmarks/vs_torch.py [--steps 10] [--layers 4 --hidden 256 --seq-len 64 --batch 8]

Three layouts of one GPT (autopar's GPT class, fp32, AdamW, gloo on local CPU processes):

* dp=2: autopar's ZeRO-0 data parallelism against ``DistributedDataParallel``;
* tp=2: autopar's program under Megatron's placements (column q/k/v and fc, row projections)
  against DTensor's ``ColwiseParallel``/``RowwiseParallel`` (``parallelize_module``) on the
  same Linears; torch keeps the embedding and head whole, autopar splits them over the
  vocabulary as Megatron does (a small vocabulary keeps that difference small);
* pp=2: autopar's 1F1B against ``torch.distributed.pipelining``'s ``Schedule1F1B`` on the
  same cut (embedding + first half of the layers | the rest + head), the tied embedding's
  gradient summed over the two stages in both.

Both programs of a layout live in the same processes and take turns, a step each on the
same batch: 3 warm-up steps, then ``--steps`` timed ones; the script prints each median
step time and the ratio autopar / torch (the target: every ratio <= 1.05). Alternating
keeps a drift of the host's load off the ratio; still, run it on an otherwise idle machine:
the ratio is the figure, the absolute times depend on the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.planner.strategies.megatron import megatron_placements
from autopar.runtime.launch import launch
from cost_models.hardware import Cluster

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
WARMUP = 3


def _model(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def _data(config: GPTConfig, batch: int, seq: int, steps: int) -> list:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, config.vocab_size, (batch, seq), generator=g),
             torch.randint(0, config.vocab_size, (batch, seq), generator=g)) for _ in range(steps)]


def _paired_medians(ours, theirs, data) -> tuple[float, float]:
    """Median seconds of a step of ``ours`` and of ``theirs``, their steps alternating on
    the same batches (so that a drift of the host's load falls on both alike)."""
    times: tuple[list, list] = ([], [])
    for k, (idx, tgt) in enumerate(data):
        for step, out in zip((ours, theirs), times):
            dist.barrier()
            start = time.perf_counter()
            step(idx, tgt)
            if k >= WARMUP:
                out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _autopar_step(config, layout: dict, batch: int, seq: int):
    with torch.device("meta"):
        meta = GPT(config)
    cluster = Cluster.local_cpu(processes=2)
    plan = autopar.plan(meta, cluster, global_batch_size=batch, seq_len=seq,
                        layout=autopar.Layout(**layout, recompute="none", dtype="fp32",
                                              sequence_parallel=False))
    if layout.get("tp", 1) > 1:
        placements = megatron_placements(trace_model(meta, seq), layout["tp"])
        plan = autopar.evaluate_plan(meta, cluster, dataclasses.replace(plan, placements=placements))
    return autopar.parallelize(_model(config), plan=plan, optimizer=ADAMW).train_step


def _ddp_step(config, batch: int):
    model = nn.parallel.DistributedDataParallel(_model(config))
    optim = ADAMW(model.parameters())
    rows = batch // dist.get_world_size()
    lo = dist.get_rank() * rows

    def step(idx, tgt):
        optim.zero_grad()
        model(idx[lo:lo + rows], tgt[lo:lo + rows])[1].backward()
        optim.step()
    return step


def _dtensor_tp_step(config):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(config)
    plan = {"attn.c_q": ColwiseParallel(), "attn.c_k": ColwiseParallel(),
            "attn.c_v": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    for block in model.transformer.h:
        parallelize_module(block, mesh, plan)
    optim = ADAMW(model.parameters())

    def step(idx, tgt):
        optim.zero_grad()
        model(idx, tgt)[1].backward()
        optim.step()
    return step


class _First(nn.Module):
    def __init__(self, gpt: GPT, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe
        self.h = nn.ModuleList(gpt.transformer.h[:layers])

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        return x


class _Last(nn.Module):
    def __init__(self, gpt: GPT, layers: int) -> None:
        super().__init__()
        self.h = nn.ModuleList(gpt.transformer.h[layers:])
        self.ln_f, self.lm_head = gpt.transformer.ln_f, nn.Linear(
            gpt.config.n_embd, gpt.config.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _pipelining_step(config, batch: int, seq: int, mbs: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, m = dist.get_rank(), batch // mbs
    gpt, cut = _model(config), config.n_layer // 2
    module = _First(gpt, cut) if rank == 0 else _Last(gpt, cut)
    tied = module.wte.weight if rank == 0 else module.lm_head.weight
    x = torch.empty(mbs, seq, config.n_embd, device="meta", requires_grad=True)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"),
                          input_args=torch.empty(mbs, seq, dtype=torch.long, device="meta")
                          if rank == 0 else x, output_args=x)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn, scale_grads=True)
    optim = ADAMW(module.parameters())

    def step(idx, tgt):
        optim.zero_grad()
        if rank == 0:
            schedule.step(idx)
        else:
            schedule.step(target=tgt)
        dist.all_reduce(tied.grad)  # the tied embedding's two partial gradients
        optim.step()
    return step


def _worker(rank: int, world: int, config: GPTConfig, args) -> dict[str, tuple[float, float]]:
    torch.set_num_threads(1)
    data = _data(config, args.batch, args.seq_len, WARMUP + args.steps)
    b, s = args.batch, args.seq_len
    runs = {
        "dp=2 vs DistributedDataParallel": lambda: (
            _autopar_step(config, dict(tp=1, pp=1, dp=2, micro_batch_size=b // 2,
                                       zero_stage=0), b, s),
            _ddp_step(config, b)),
        "tp=2 vs DTensor Colwise/Rowwise": lambda: (
            _autopar_step(config, dict(tp=2, pp=1, dp=1, micro_batch_size=b), b, s),
            _dtensor_tp_step(config)),
        "pp=2 vs pipelining Schedule1F1B": lambda: (
            _autopar_step(config, dict(tp=1, pp=2, dp=1, micro_batch_size=args.mbs,
                                       schedule="1f1b"), b, s),
            _pipelining_step(config, b, s, args.mbs)),
    }
    return {name: _paired_medians(*build(), data) for name, build in runs.items()
            if args.only in (None, name.split()[0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size of the pp=2 layout")
    p.add_argument("--only", choices=["dp=2", "tp=2", "pp=2"], help="one layout")
    args = p.parse_args()
    config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.hidden,
                       vocab_size=args.vocab, block_size=args.seq_len)
    results = launch(_worker, 2, config, args, timeout_s=1800)
    print(f"GPT {args.layers} layers, h={args.hidden}, V={args.vocab}, s={args.seq_len}, "
          f"B={args.batch}, fp32, AdamW, gloo, world size 2; median of {args.steps} steps "
          f"after {WARMUP} warm-up (rank 0)")
    print(f"{'layout':36} {'autopar (ms)':>13} {'torch (ms)':>11} {'ratio':>7}")
    for name, (ours, theirs) in results[0].items():
        print(f"{name:36} {ours * 1e3:13.1f} {theirs * 1e3:11.1f} {ours / theirs:7.3f}")


if __name__ == "__main__":
    main()
