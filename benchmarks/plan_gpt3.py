"""Planning speed and the published GPT-3 175B reference point.

    python benchmarks/plan_gpt3.py

Prints the solve time of `autopar.plan` for GPT-3 175B on 128 DGX A100 nodes (target:
under 30 s on a 2-core machine), the chosen plan, and Megatron-LM's published layout
(TP 8, PP 16, DP 8, micro-batch 1, full recompute; ~140 TFLOP/s per GPU measured,
Narayanan et al. 2021, Table 1) priced by the same cost model.
"""

from __future__ import annotations

import time

import autopar

PUBLISHED_TFLOPS = 140.0


def main() -> None:
    model, name = autopar.load_model("gpt3-175b")
    cluster = autopar.Cluster.dgx_a100(nodes=128)
    start = time.perf_counter()
    plan = autopar.plan(model, cluster, global_batch_size=1536, seq_len=2048, model_name=name)
    wall = time.perf_counter() - start
    print(f"autopar.plan wall time: {wall:.1f} s (target < 30 s)")
    print(f"auto:     {plan.summary()}")
    hand = autopar.evaluate(model, cluster, autopar.Layout(tp=8, pp=16, dp=8, micro_batch_size=1,
                                                           recompute="full"),
                            global_batch_size=1536, seq_len=2048, model_name=name)
    print(f"megatron: {hand.summary()}")
    err = (hand.predicted.tflops_per_gpu - PUBLISHED_TFLOPS) / PUBLISHED_TFLOPS
    print(f"megatron predicted {hand.predicted.tflops_per_gpu:.1f} TFLOP/s/GPU vs published "
          f"{PUBLISHED_TFLOPS:.0f}: {err:+.1%} (target within 25%)")
    print(f"auto / megatron step time: {plan.predicted.step_time_s / hand.predicted.step_time_s:.3f}")


if __name__ == "__main__":
    main()
