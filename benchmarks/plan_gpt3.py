"""Planning speed and the published GPT-3 175B reference point.

    python benchmarks/plan_gpt3.py

Prints the wall and CPU time (``time.process_time``: every thread of the process, CP-SAT's
included; wall time on a shared machine counts other processes too) of `autopar.plan` for
GPT-3 175B on 128 DGX A100 nodes (target: under 5 s wall on a 2-core machine) and for the
1T GPT of Narayanan et al. 2021, Table 1 on 384 nodes (B = 3072; target: under 10 s), the
chosen plans, and Megatron-LM's published layout
(TP 8, PP 16, DP 8, micro-batch 1, full recompute; ~140 TFLOP/s per GPU measured,
Narayanan et al. 2021, Table 1) priced by the same cost model.
"""

from __future__ import annotations

import time

import autopar

PUBLISHED_TFLOPS = 140.0


TARGETS = (("gpt3-175b", 128, 1536, 5.0), ("gpt-1t", 384, 3072, 10.0))


def timed_plan(spec: str, nodes: int, batch: int, target_s: float):
    """Plan ``spec`` on ``nodes`` DGX A100 nodes; prints wall and CPU seconds; returns
    (model, name, cluster, plan)."""
    model, name = autopar.load_model(spec)
    cluster = autopar.Cluster.dgx_a100(nodes=nodes)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = autopar.plan(model, cluster, global_batch_size=batch, seq_len=2048, model_name=name)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{spec} on {nodes * 8} A100: autopar.plan wall {wall:.1f} s, CPU {cpu:.1f} s "
          f"(target < {target_s:.0f} s wall)")
    print(f"  auto: {plan.summary()}")
    return model, name, cluster, plan


def main() -> None:
    model, name, cluster, plan = timed_plan(*TARGETS[0])
    for target in TARGETS[1:]:
        timed_plan(*target)
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
