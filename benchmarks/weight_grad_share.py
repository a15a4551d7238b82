"""The weight-gradient part of the backward: predicted (``StrategyCost.wgrad_s``) against
measured, for the transformer layers of a GPT on one GPU.

    python benchmarks/weight_grad_share.py [--layers 12 --hidden 768 --heads 12 --seq-len 1024 --batch 8]
    python benchmarks/weight_grad_share.py --cpu --layers 2 --hidden 64 --heads 4 --seq-len 64 --batch 4

A zero-bubble schedule runs each backward as B (the input gradient) and W (the weight
gradient) and fills the bubble with the W's, so its price rests on the W/B split of the
cost model (:func:`autopar.planner.costs.matmul_cost.gemm_times_s`: a linear's dW GEMM; attention
and element-wise ops none). Measured with public autograd alone: the layers' forward, then
``torch.autograd.grad`` of a loss with respect to the layers' input only (autograd runs the
input-gradient path: B) or to the input and every parameter (B + W); W is the difference.
bf16 autocast over fp32 weights on a GPU (the scheme the cost model prices), fp32 on the
CPU; medians of ``--steps`` runs after warm-up. Predicted on the preset of the GPU
(``benchmarks/gpu_check.py``'s ``device_preset``; ``local-cpu`` with ``--cpu``) at tp = 1:
sums over the layers' nodes of ``bwd_s`` and ``wgrad_s``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import autopar
from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.oracle.section_vectors import replicated_index
from autopar.planner.costs.tables import Config, cost_tables
from autopar.planner.strategies import node_strategies
from gpu_check import device_preset  # benchmarks/ is on sys.path when run as a script


def predicted_s(config: GPTConfig, batch: int, seq: int, preset: str, dtype: str
                ) -> tuple[float, float]:
    """(backward, weight-gradient) seconds the cost model gives the layers of ``config``."""
    with torch.device("meta"):
        meta = GPT(config)
    traced = trace_model(meta, seq)
    cluster = autopar.Cluster.from_name(preset)
    strategies = node_strategies(traced, 1)
    tables = cost_tables(traced, strategies, cluster,
                         Config(tp=1, pp=1, dp=1, micro_batch_size=batch, num_micro_batches=1,
                                dtype=dtype, attention=cluster.attention))
    names = [n for layer in traced.layers for n in layer]
    costs = [tables.node[n][replicated_index(strategies, n)] for n in names]
    return sum(c.bwd_s for c in costs), sum(c.wgrad_s for c in costs)


def measured_s(config: GPTConfig, batch: int, seq: int, device: torch.device, steps: int
               ) -> tuple[float, float, float]:
    """(forward, input-gradient B, weight-gradient W) seconds of the layers, medians."""
    torch.manual_seed(0)
    blocks = GPT(config).transformer.h.to(device)
    params = [p for p in blocks.parameters()]
    x = torch.randn(batch, seq, config.n_embd, device=device, requires_grad=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def run(wrt) -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with autocast:
            out = x
            for block in blocks:
                out = block(out)
            loss = out.float().square().mean()
        if wrt is not None:
            torch.autograd.grad(loss, wrt)
        sync()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"forward": [], "input": [], "all": []}
    for step in range(steps + 3):
        for key, wrt in (("forward", None), ("input", [x]), ("all", [x] + params)):
            elapsed = run(wrt)
            if step >= 3:
                times[key].append(elapsed)
    fwd, inp, full = (statistics.median(times[k]) for k in ("forward", "input", "all"))
    return fwd, inp - fwd, full - inp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="rehearse on the CPU")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no GPU: pass --cpu to rehearse on the CPU")
    device = torch.device("cpu" if args.cpu else "cuda:0")
    config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.hidden,
                       vocab_size=50304, block_size=args.seq_len)
    preset = "local-cpu" if args.cpu else device_preset(torch.cuda.get_device_name(0))
    bwd, wgrad = predicted_s(config, args.batch, args.seq_len, preset,
                             "fp32" if args.cpu else "bf16")
    fwd, b, w = measured_s(config, args.batch, args.seq_len, device, args.steps)
    name = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    print(f"torch {torch.__version__}, {name}, priced on {preset}: {args.layers} layers, "
          f"h={args.hidden}, s={args.seq_len}, b={args.batch}")
    print(f"predicted: backward {bwd * 1e3:.2f} ms, of it W {wgrad * 1e3:.2f} ms "
          f"(W share {wgrad / bwd:.3f})")
    print(f"measured:  forward {fwd * 1e3:.2f} ms, B {b * 1e3:.2f} ms, W {w * 1e3:.2f} ms "
          f"(W share {w / (b + w):.3f})")
    print(f"W share predicted - measured: {wgrad / bwd - w / (b + w):+.3f}")


if __name__ == "__main__":
    main()
