"""autopar in two minutes: plan GPT-3 175B on 1024 A100s, then train a tiny GPT on 4 CPU ranks.

Run from the repository root::

    python examples/quickstart.py            # both parts
    python examples/quickstart.py --skip-175b   # only the 4-process training part

Part 1 plans GPT-3 175B (built on the meta device: nothing is allocated) on 128 DGX A100
nodes for a global batch of 1536 sequences of 2048 tokens, prices Megatron-LM's published
layout (t=8, p=16, d=8, b=1, full recompute; Narayanan et al. 2021) with the same cost
model, and writes ``reports/gpt3-175b-dgx-a100-128/report.md``.

Part 2 trains a tiny GPT for 5 SGD steps on 4 local CPU processes joined by gloo, with a
fixed layout of tensor parallel 2 × pipeline parallel 2, and prints each step's loss next
to the loss of the same model trained in one process on the same batches.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

try:
    import autopar
except ModuleNotFoundError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import autopar
from autopar import Cluster, Layout
from autopar.models import GPT, PRESETS
from autopar.report.format import format_seconds
from autopar.runtime.launch import launch
from make_reports import CASES, write_example  # examples/make_reports.py, beside this file

REPO = Path(__file__).resolve().parents[1]
TINY = PRESETS["gpt-tiny"]           # L=2, a=4, h=32, V=64, s=16
WORLD_SIZE, STEPS, BATCH, LR, SEED = 4, 5, 8, 0.5, 0


# ------------------------------------------------------------------- part 1: plan
def plan_gpt3_175b() -> None:
    """Plan GPT-3 175B on 128 DGX A100 nodes, compare with Megatron-LM's layout and write
    the checked-in example report (the same one ``examples/make_reports.py`` writes)."""
    plan, megatron, path = write_example(*CASES[0])
    print(f"auto plan  : {plan.summary()}")
    print(f"solved in {format_seconds(plan.solve_wall_s)} ({plan.solver.status})")
    print(f"Megatron-LM: {megatron.summary()}")
    speedup = megatron.predicted.step_time_s / plan.predicted.step_time_s
    print(f"auto/Megatron step time: {1 / speedup:.2f} (the auto plan is {speedup:.2f}x "
          f"{'faster' if speedup >= 1 else 'slower'})")
    print(f"report: {path.relative_to(REPO)}")


# ----------------------------------------------------------------- part 2: train
def batches(steps: int, batch: int, seq_len: int, vocab: int) -> list[tuple[torch.Tensor, ...]]:
    """Deterministic (idx, targets) pairs, (B, s) int64 each; targets are idx shifted by one.

    Each row counts up modulo V from a random start (``t, t+1, t+2 ...``): a pattern a tiny
    GPT learns within a few steps, so the loss visibly falls.
    """
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        tokens = (start + torch.arange(seq_len + 1)) % vocab  # (B, s + 1)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def reference_losses(data: list) -> list[float]:
    """Single-process SGD on the same model (same seed) and the same batches."""
    torch.manual_seed(SEED)
    model = GPT(TINY)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for idx, targets in data:
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def tiny_plan():
    """The plan for 4 CPU ranks with a fixed t=2, p=2 layout (the solver fills in the rest)."""
    with torch.device("meta"):  # planning never needs real weights
        model = GPT(TINY)
    cluster = Cluster.local_cpu(processes=WORLD_SIZE)
    layout = Layout(tp=2, pp=2, dp=1, micro_batch_size=2)
    return autopar.plan(model, cluster, global_batch_size=BATCH, seq_len=TINY.block_size,
                        layout=layout, model_name="gpt-tiny")


def worker(rank: int, world_size: int, plan, data: list, reference: list[float]) -> None:
    """One rank (in a gloo process group that ``launch`` set up): parallelize the same-seed
    model by ``plan``, train, print (rank 0)."""
    torch.manual_seed(SEED)
    model = GPT(TINY)  # identical weights on every rank; parallelize keeps this rank's shard
    parallel = autopar.parallelize(
        model, Cluster.local_cpu(processes=world_size), plan,
        optimizer=functools.partial(torch.optim.SGD, lr=LR),
        global_batch_size=BATCH, seq_len=TINY.block_size)
    for step, (idx, targets) in enumerate(data):
        loss = parallel.train_step(idx, targets)  # the same float on every rank
        if rank == 0:
            print(f"  step {step}: loss {loss:.6f} on {world_size} ranks, {reference[step]:.6f} "
                  f"in one process (diff {abs(loss - reference[step]):.1e})", flush=True)


def train_tiny_gpt() -> None:
    """Plan, then spawn 4 gloo ranks that train 5 steps; rank 0 prints both loss curves."""
    plan = tiny_plan()
    print(f"plan for 4 CPU ranks: {plan.summary()}")
    data = batches(STEPS, BATCH, TINY.block_size, TINY.vocab_size)
    reference = reference_losses(data)
    # 4 gloo processes on 127.0.0.1; a failing rank raises here with its traceback
    launch(worker, WORLD_SIZE, plan, data, reference, timeout_s=600)


def main() -> None:
    """Run part 1 (plan 175B) and part 2 (train on 4 CPU ranks) unless skipped."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-175b", action="store_true", help="skip part 1 (planning 175B)")
    parser.add_argument("--skip-train", action="store_true", help="skip part 2 (4-rank training)")
    args = parser.parse_args()
    if not args.skip_175b:
        print("== 1. GPT-3 175B on 128 DGX A100 nodes ==")
        start = time.perf_counter()
        plan_gpt3_175b()
        print(f"(part 1 took {time.perf_counter() - start:.1f} s)\n")
    if not args.skip_train:
        print(f"== 2. a tiny GPT on {WORLD_SIZE} CPU processes (gloo), {STEPS} SGD steps ==")
        start = time.perf_counter()
        train_tiny_gpt()
        print(f"(part 2 took {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
