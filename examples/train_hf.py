"""Train a Hugging Face causal LM (random weights, built from a config) with an autopar plan.

    torchrun --nproc-per-node 2 examples/train_hf.py                 # a tiny Llama, 2 ranks
    torchrun --nproc-per-node 2 examples/train_hf.py --tp 2 --steps 5
    torchrun --nproc-per-node 2 examples/train_hf.py --pp 2        # two pipeline stages
    torchrun --nproc-per-node 2 examples/train_hf.py --model hf:path/to/config.json

The default model is a 2-layer Llama (h = 64, 4 heads, 2 kv heads, V = 128) from
``transformers.LlamaConfig``; ``--model`` takes any spec of ``autopar.load_model``
(``hf:CONFIG``: a config.json, ``hf:gpt2`` ..., ``hf:mistral``). Rank 0 plans the model on
the meta device for ``Cluster.local_cpu(processes=world_size)`` and broadcasts the plan;
every rank builds the same seeded model and ``autopar.parallelize`` keeps its share. The
batches count up modulo V from a random start (``t, t+1, t+2 ...``): a pattern the model
learns within a few steps, so the loss falls.
"""

from __future__ import annotations

import argparse
import functools
import sys
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


def tiny_llama() -> torch.nn.Module:
    """2 layers, h = 64, 4 heads (2 kv), SwiGLU 128, V = 128, 64 positions: random weights.
    Also a factory for the CLI: ``autopar plan --model examples.train_hf:tiny_llama ...``."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=128, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config)


def build(spec: str | None, device: str, seed: int) -> torch.nn.Module:
    """The model of ``--model`` (any autopar.load_model spec), or the tiny Llama."""
    if spec is not None:
        return autopar.load_model(spec, device=device, seed=seed)[0]
    torch.manual_seed(seed)
    with torch.device(device):
        return tiny_llama()


def batch(step: int, size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (idx, targets), (B, s) each, the same on every rank; targets = idx + 1."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    tokens = (start + torch.arange(seq_len + 1)) % vocab  # (B, s + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, metavar="SPEC", help="default: the tiny Llama")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="global batch B in sequences")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--tp", type=int, default=None, help="pin the tensor-parallel size")
    p.add_argument("--dp", type=int, default=None, help="pin the data-parallel size")
    p.add_argument("--pp", type=int, default=None, help="pin the pipeline-parallel size")
    args = p.parse_args()

    torch.set_num_threads(1)  # the ranks share a few cores
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # torchrun's env://
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cluster = Cluster.local_cpu(processes=world)
        payload = [None]
        if rank == 0:  # plan on the meta device: shapes only, nothing allocated
            plan = autopar.plan(build(args.model, "meta", 0), cluster,
                                global_batch_size=args.batch_size, seq_len=args.seq_len,
                                layout=Layout(tp=args.tp, pp=args.pp, dp=args.dp),
                                model_name=args.model or "examples.train_hf:tiny_llama")
            payload = [plan.to_json()]
            print(f"{world} ranks; plan: {plan.summary()}", flush=True)
        dist.broadcast_object_list(payload, src=0)
        model = build(args.model, "cpu", seed=0)  # the same weights on every rank
        vocab = model.config.vocab_size
        parallel = autopar.parallelize(
            model, cluster, Plan.from_json(payload[0]),
            optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0))
        for step in range(args.steps):
            loss = parallel.train_step(*batch(step, args.batch_size, args.seq_len, vocab))
            if rank == 0:
                print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
