"""ZB-H1 against 1F1B, predicted by autopar and measured by Qi et al. 2024.

    python benchmarks/zero_bubble_qi2024.py [--models 1.5B,6.2B] [--out FILE]

Source: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv
2401.10241): Table 3 (the models: GPT, sequence 1024, pure pipeline parallelism, p = the
number of A100 SXM 80G GPUs, the first and last stages one layer fewer), Table 4 (samples
per GPU per second of 1F1B and ZB-1p; ZB-1p is their automatic schedule under 1F1B's
memory, whose bubble equals ZB-H1's in their Table 5). The paper states neither the
vocabulary nor the precision; priced here with GPT-2's padded vocabulary (50,304) in bf16
(their example script trains fp16, the same speed on an A100).

For each model and m, ``autopar.evaluate`` prices the two layouts on ``Cluster.dgx_a100``
(tp = dp = 1, p and b as published, the paper's stage cut, no recompute) and prints the predicted gain
of ZB-H1 over 1F1B, T(1F1B)/T(ZB-H1) - 1, beside the published one,
throughput(ZB-1p)/throughput(1F1B) - 1; issue 33's target is within 5 points.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

import autopar
from autopar.models import GPT, GPTConfig

SOURCE = "Qi et al. 2024 (ICLR), Tables 3 and 4"


@dataclass(frozen=True)
class ZeroBubbleRow:
    """One model of Table 3 and its Table 4 throughputs (samples per GPU per second) at
    each m: ``one_f_one_b[k]`` and ``zb_1p[k]`` at ``micro_batches[k]``."""

    name: str
    layers: int
    heads: int
    hidden: int
    pp: int
    micro_batch_size: int
    micro_batches: tuple[int, ...]
    one_f_one_b: tuple[float, ...]
    zb_1p: tuple[float, ...]


ROWS = (
    ZeroBubbleRow("1.5B", 22, 24, 2304, 8, 6, (24, 32, 64), (11.8, 12.5, 13.6), (12.9, 13.4, 14.2)),
    ZeroBubbleRow("6.2B", 30, 32, 4096, 8, 3, (24, 32, 64), (3.50, 3.70, 4.03), (3.88, 4.00, 4.20)),
    ZeroBubbleRow("14.6B", 46, 40, 5120, 16, 1, (48, 64, 128), (1.40, 1.49, 1.64),
                  (1.61, 1.67, 1.76)),
    ZeroBubbleRow("28.3B", 62, 48, 6144, 32, 1, (96, 128, 256), (0.76, 0.80, 0.88),
                  (0.87, 0.90, 0.96)),
)
SEQ_LEN, VOCAB = 1024, 50304


def stage_layers(layers: int, pp: int) -> list[list[int]]:
    """The paper's cut: the first and the last stage one layer fewer than the others."""
    inner = (layers + 2) // pp
    sizes = [inner - 1] + [inner] * (pp - 2) + [inner - 1]
    if sum(sizes) != layers:
        raise ValueError(f"{layers} layers do not cut as the paper's {pp} stages")
    bounds, start = [], 0
    for n in sizes:
        bounds.append([start, start + n])
        start += n
    return bounds


def predicted_step_s(row: ZeroBubbleRow, m: int, schedule: str) -> float:
    """autopar's step time of ``row`` at m micro-batches under ``schedule`` (seconds)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=row.layers, n_head=row.heads, n_embd=row.hidden,
                              vocab_size=VOCAB, block_size=SEQ_LEN))
    cluster = autopar.Cluster.dgx_a100(nodes=max(1, row.pp // 8))
    layout = autopar.Layout(tp=1, pp=row.pp, dp=1, micro_batch_size=row.micro_batch_size,
                            zero_stage=0, recompute="none", schedule=schedule, dtype="bf16")
    plan = autopar.evaluate(model, cluster, layout, global_batch_size=row.micro_batch_size * m,
                            seq_len=SEQ_LEN, stage_layers=stage_layers(row.layers, row.pp))
    return plan.predicted.step_time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(r.name for r in ROWS))
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    wanted = args.models.split(",")
    lines = [f"ZB-H1 vs 1F1B, predicted on dgx-a100 against {SOURCE}", "",
             "| model | p | b | m | 1F1B step (s) | ZB-H1 step (s) | predicted gain | "
             "published gain | difference (points) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst, start = 0.0, time.time()
    for row in (r for r in ROWS if r.name in wanted):
        for m, base, zb in zip(row.micro_batches, row.one_f_one_b, row.zb_1p):
            t1, tz = predicted_step_s(row, m, "1f1b"), predicted_step_s(row, m, "zb_h1")
            predicted, published = t1 / tz - 1, zb / base - 1
            worst = max(worst, abs(predicted - published) * 100)
            lines.append(f"| {row.name} | {row.pp} | {row.micro_batch_size} | {m} | {t1:.3f} | "
                         f"{tz:.3f} | {predicted:+.1%} | {published:+.1%} | "
                         f"{(predicted - published) * 100:+.1f} |")
            print(lines[-1], flush=True)
    lines += ["", f"largest difference: {worst:.1f} points (target: within 5); "
                  f"{time.time() - start:.0f} s"]
    print("\n".join(lines[-2:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
