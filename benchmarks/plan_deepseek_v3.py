"""Planning speed for a DeepSeek-V3-sized model: transformers' ``DeepseekV3Config()`` defaults
(671B parameters, 61 layers of which the first 3 dense, 256 routed experts top-8, multi-head
latent attention) on 2,048 H800 GPUs (256 DGX H800 nodes), global batch 15,360 sequences of
4,096 tokens (DeepSeek-V3 technical report, section 4.2), built on the meta device.

    python benchmarks/plan_deepseek_v3.py [--json PATH] [--profile PATH]

Prints the capture time (``trace_model`` alone), the time of ``autopar.plan`` (its own
capture and the search), the total wall time and the plan's headline; ``--json`` writes
the plan (to compare two versions of autopar: the same plan and predictions), ``--profile``
a cProfile of the ``plan`` call. Issue 34's goal: ``plan`` under 10 s on two cores.
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.graph.capture import trace_model  # noqa: E402
from cost_models.hardware import Cluster  # noqa: E402

NODES = 256  # DGX H800 nodes of 8 GPUs: 2,048 GPUs
GLOBAL_BATCH = 15360
SEQ_LEN = 4096


def main(argv: list[str] | None = None) -> int:
    """Time the capture and the plan of DeepSeek-V3 (module docstring)."""
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the plan as JSON to this path")
    ap.add_argument("--profile", help="write a cProfile of the plan call to this path")
    ap.add_argument("--skip-trace", action="store_true",
                    help="do not time trace_model alone (plan captures the model itself)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    with torch.device("meta"):
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config())
    n = sum(p.numel() for p in model.parameters())
    print(f"built {n / 1e9:.1f}B parameters in {time.perf_counter() - start:.1f} s")
    if not args.skip_trace:
        t = time.perf_counter()
        traced = trace_model(model, SEQ_LEN, dtype="bf16")
        print(f"trace {time.perf_counter() - t:.1f} s ({len(traced.nodes)} nodes, "
              f"{traced.num_layers} layers in the stack)")
    # expert parallelism: the "autopar" target runs it (RUNTIME_SUPPORT.expert_parallel,
    # default True), so plan searches every ep its rules allow without a patch
    cluster = Cluster.dgx_h800(NODES)
    profiler = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if profiler:
        profiler.enable()
    plan = autopar.plan(model, cluster, global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN,
                        model_name="deepseek-v3")
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    plan_s = time.perf_counter() - t
    print(f"plan {plan_s:.1f} s (search {plan.solve_wall_s:.1f} s)")
    print(f"total {time.perf_counter() - start:.1f} s")
    print(plan.headline(), plan.solver.status)
    if args.json:
        Path(args.json).write_text(plan.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
