"""Train a small GPT on real text across local CPU processes with an autopar plan.

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 50   # 4 gloo ranks
    python examples/train_gpt.py --single --steps 50               # the 1-process reference
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 examples/train_gpt.py --plan plan.json   # on each node

The text is the Python standard library's own source (the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]``, sorted by name and concatenated), so every machine
has it. Tokens are bytes (V = 256). Every rank draws the same batches from the same
seeded generator, and builds the same seeded model; rank 0 solves the plan for
``Cluster.local_cpu(processes=world_size)`` and broadcasts it, so every rank runs the
same plan. ``autopar.parallelize`` turns the model into this rank's part of the
distributed program; ``train_step`` returns the global mean loss on every rank.

Pin decisions with ``--tp/--pp/--dp/--mbs`` (e.g. ``--tp 2 --pp 2``); by default the
solver picks the layout it predicts fastest for the local CPU profile. ``--plan FILE``
skips solving: every rank reads the same saved plan (``autopar plan ... -o FILE`` or
``--save-plan FILE`` of an earlier run), and ``parallelize`` checks that all ranks hold
the same decisions before the first collective. The process-group backend decides the
device: gloo (the default) keeps each rank on the CPU, ``--backend nccl`` puts it on
``cuda:LOCAL_RANK`` (``autopar/runtime/device.py``; not yet run on GPUs). The same seed with ``--single`` gives the loss curve the
distributed run should reproduce (up to rounding).

Checkpoints: ``--checkpoint-dir DIR`` saves the whole training state every
``--checkpoint-every`` steps into ``DIR/step_NNNNNN`` (a ``torch.distributed.checkpoint``
directory per save, written by every rank: parameters, optimizer states, the step count, the
RNG streams and the data position; whole or absent: staged, then renamed into place with a
manifest of checksums); ``--resume`` loads the newest complete one, skipping (and naming)
newer ones a crash left incomplete or that are damaged, and continues from its step, with
the same batches an uninterrupted run would draw. The checkpoint holds the model under its
original parameter names, so the resumed run may use another plan or world size::

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 100 --checkpoint-dir ckpt
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 100 --checkpoint-dir ckpt --resume
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import sysconfig
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import autopar
except ModuleNotFoundError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import autopar
from autopar import Cluster, Layout, Plan
from autopar.models import GPT, GPTConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags of this example."""
    p = argparse.ArgumentParser(description="Train a small byte-level GPT on the Python "
                                "standard library's source with an autopar plan.")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    p.add_argument("--single", action="store_true",
                   help="train in this one process without torch.distributed (the reference)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch B in sequences")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence s (<= 64)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=None, help="default: 3e-3 AdamW, 0.1 SGD")
    p.add_argument("--seed", type=int, default=0, help="model init and batch sampling seed")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="text bytes to load")
    for flag in ("tp", "pp", "dp"):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"pin the {flag} size")
    p.add_argument("--mbs", type=int, default=None, help="pin the micro-batch size b")
    p.add_argument("--plan", type=Path, default=None, metavar="FILE",
                   help="a saved plan (autopar plan -o FILE); every rank reads it, no solving")
    p.add_argument("--save-plan", type=Path, default=None, metavar="FILE",
                   help="rank 0 writes the plan it ran to FILE (reuse it with --plan)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="save a checkpoint into DIR/step_NNNNNN every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                   help="steps between checkpoints (default 10)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (if any)")
    p.add_argument("--losses-file", type=Path, default=None, metavar="FILE",
                   help="rank 0 appends one JSON line {step, loss} per step to FILE")
    p.add_argument("--crash-after-checkpoint", type=int, default=None, metavar="STEP",
                   help="(for tests) after saving the checkpoint of step STEP, every rank "
                        "exits at once with status 17, like a killed job")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="torch.distributed backend: gloo keeps each rank on the CPU (the "
                        "default), nccl puts it on cuda:LOCAL_RANK")
    return p.parse_args(argv)


def model_config() -> GPTConfig:
    """4 layers, h = 128, 4 heads, s = 64, bytes as tokens (about 0.8M parameters)."""
    return GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=64)


def gpt_stdlib_bytes() -> GPT:
    """The model this example trains, as a factory for the CLI:
    ``autopar plan --model examples.train_gpt:gpt_stdlib_bytes --cluster local-cpu
    --global-batch-size 16 -o plan.json`` (built on the meta device there)."""
    return GPT(model_config())


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the stdlib's top-level .py files in sorted order: (n,) int64 tokens in [0, 256)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):  # top level only: site-packages differ per machine
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(f"found only {len(text)} bytes of Python source under {stdlib}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def get_batch(tokens: torch.Tensor, step: int, batch: int, seq_len: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, the same on every rank: idx, targets (B, s), targets shifted by 1."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
    idx = torch.stack([tokens[i:i + seq_len] for i in starts.tolist()])
    targets = torch.stack([tokens[i + 1:i + 1 + seq_len] for i in starts.tolist()])
    return idx, targets


def make_optimizer(args: argparse.Namespace):
    """An optimizer factory ``params -> Optimizer`` (what autopar.parallelize expects)."""
    if args.optimizer == "sgd":
        return functools.partial(torch.optim.SGD, lr=args.lr or 0.1)
    return functools.partial(torch.optim.AdamW, lr=args.lr or 3e-3, weight_decay=0.0)


def load_or_solve(args: argparse.Namespace, cluster: Cluster, rank: int) -> Plan:
    """The plan of ``--plan FILE`` (read on every rank), else rank 0 solves and broadcasts.

    Raises ValueError when the saved plan is for another batch, sequence length or world
    size than this run's.
    """
    if args.plan is None:
        return solve_and_broadcast(args, cluster, rank)
    plan = Plan.from_json(args.plan.read_text(encoding="utf-8"))
    wanted = (args.batch_size, args.seq_len, cluster.num_gpus)
    if (plan.global_batch_size, plan.seq_len, plan.num_gpus) != wanted:
        raise ValueError(f"{args.plan} plans B={plan.global_batch_size}, s={plan.seq_len} on "
                         f"{plan.num_gpus} ranks, but this run has B={wanted[0]}, "
                         f"s={wanted[1]} on {wanted[2]} ranks")
    return plan


def solve_and_broadcast(args: argparse.Namespace, cluster: Cluster, rank: int) -> Plan:
    """Rank 0 solves the plan (on a meta model); every rank receives the same plan."""
    payload = [None]
    if rank == 0:
        with torch.device("meta"):
            meta_model = GPT(model_config())
        layout = Layout(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch_size=args.mbs)
        plan = autopar.plan(meta_model, cluster, global_batch_size=args.batch_size,
                            seq_len=args.seq_len, layout=layout, model_name="gpt-stdlib-bytes")
        payload = [plan.to_json()]
    dist.broadcast_object_list(payload, src=0)
    return Plan.from_json(payload[0])


def train(step_fn, tokens: torch.Tensor, args: argparse.Namespace, rank: int,
          first_step: int = 0, after_step=None) -> list[float]:
    """Run steps ``first_step`` .. ``args.steps - 1`` of ``step_fn(idx, targets) -> loss``;
    rank 0 prints progress (and appends to ``--losses-file``); ``after_step(step)`` runs
    after each step (checkpoints)."""
    losses, start = [], time.perf_counter()
    for step in range(first_step, args.steps):
        idx, targets = get_batch(tokens, step, args.batch_size, args.seq_len, args.seed)
        losses.append(step_fn(idx, targets))
        if rank == 0 and args.losses_file is not None:
            with args.losses_file.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "loss": losses[-1]}) + "\n")
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            elapsed = time.perf_counter() - start
            tok_s = len(losses) * args.batch_size * args.seq_len / elapsed
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({tok_s:,.0f} tokens/s)", flush=True)
        if after_step is not None:
            after_step(step)
    return losses


def save_every(parallel, args: argparse.Namespace, rank: int, step: int) -> None:
    """After step ``step``: every ``--checkpoint-every`` steps save the training state with
    the data position (the next step; batches are a function of the step and the seed)."""
    if args.checkpoint_dir is None or (step + 1) % args.checkpoint_every:
        return
    path = args.checkpoint_dir / f"step_{step + 1:06d}"
    parallel.save_checkpoint(path, extra={"next_step": step + 1, "seed": args.seed})
    if rank == 0:
        print(f"saved checkpoint {path}", flush=True)
    if args.crash_after_checkpoint == step + 1:
        os._exit(17)  # no cleanup, no barrier: as if the job were killed here


def resume(parallel, args: argparse.Namespace, rank: int) -> int:
    """Load the newest complete checkpoint of ``--checkpoint-dir``, skipping (and saying
    why) newer ones that a crash left incomplete or that are damaged; returns the step to
    start from (0 when there is none). Raises SystemExit if it was made with another
    ``--seed``."""
    loaded = parallel.load_latest_checkpoint(args.checkpoint_dir)
    if rank == 0:
        for path, why in loaded.skipped:
            print(f"skipped checkpoint {path}: {why}", flush=True)
    if loaded.path is None:
        if rank == 0:
            print(f"no complete checkpoint in {args.checkpoint_dir}: starting at step 0",
                  flush=True)
        return 0
    extra = loaded.extra
    if extra["seed"] != args.seed:
        raise SystemExit(f"{loaded.path} was trained with --seed {extra['seed']}, not {args.seed}")
    if rank == 0:
        print(f"resumed from {loaded.path} at step {extra['next_step']}", flush=True)
    return extra["next_step"]


def single_process_step(model: GPT, optimizer):
    """The reference step: forward, backward and update of the whole model in this process."""
    def step(idx: torch.Tensor, targets: torch.Tensor) -> float:
        """One SGD/AdamW step on the batch; returns the mean token cross-entropy."""
        optimizer.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def summarize(losses: list[float], window: int) -> str:
    """Mean loss of the first and of the last ``window`` steps (single steps are noisy)."""
    window = max(1, min(window, len(losses)))
    first, last = losses[:window], losses[-window:]
    return (f"mean loss of the first {window} steps {sum(first) / window:.4f} -> "
            f"last {window} steps {sum(last) / window:.4f}")


def main(argv: list[str] | None = None) -> None:
    """Single-process reference with --single; otherwise one torchrun rank."""
    args = parse_args(argv)
    if not 1 <= args.seq_len <= model_config().block_size:
        raise SystemExit(f"--seq-len must be in [1, {model_config().block_size}]")
    if args.resume and args.checkpoint_dir is None:
        raise SystemExit("--resume needs --checkpoint-dir")
    if args.single and args.checkpoint_dir is not None:
        raise SystemExit("checkpoints are saved by the distributed run; drop --single")
    tokens = load_corpus(args.max_bytes)
    if args.single:
        torch.manual_seed(args.seed)
        model = GPT(model_config())
        print(f"single process, {len(tokens):,} bytes of stdlib source, {args.steps} steps")
        losses = train(single_process_step(model, make_optimizer(args)(model.parameters())),
                       tokens, args, rank=0)
        print(summarize(losses, args.log_every))
        return
    torch.set_num_threads(1)  # several ranks share a few cores
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))  # torchrun's env://
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        cluster = Cluster.local_cpu(processes=world_size)
        plan = load_or_solve(args, cluster, rank)
        if rank == 0 and args.save_plan:
            args.save_plan.write_text(plan.to_json() + "\n", encoding="utf-8")
        if rank == 0:
            print(f"{world_size} ranks, {len(tokens):,} bytes of stdlib source; plan: "
                  f"{plan.summary()}", flush=True)
        torch.manual_seed(args.seed)
        model = GPT(model_config())  # the same weights on every rank before sharding
        parallel = autopar.parallelize(model, cluster, plan, optimizer=make_optimizer(args),
                                       global_batch_size=args.batch_size, seq_len=args.seq_len)
        first_step = resume(parallel, args, rank) if args.resume else 0
        losses = train(parallel.train_step, tokens, args, rank, first_step,
                       functools.partial(save_every, parallel, args, rank))
        if rank == 0 and losses:  # none when resumed at the last step
            print(summarize(losses, args.log_every))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
