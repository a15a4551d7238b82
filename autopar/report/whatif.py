"""The "What if" section of a plan report: the same model re-planned on changed inputs.

The re-planning is :func:`autopar.api.what_if_plans` (twice the nodes, H100 instead of
A100 nodes of the same count, twice the global batch); ``what_if_markdown`` only renders
the Plans it returns. Each entry is a Plan or a string saying why it has none (e.g. no
plan fits). Step time in seconds, throughput in model TFLOP/s per GPU.
"""

from __future__ import annotations

from autopar.contract.plan import Plan

__all__ = ["what_if_markdown"]


def what_if_markdown(plan: Plan, what_ifs: dict[str, Plan | str]) -> str:
    """A '## What if' section: each changed input's plan beside the chosen one."""
    base = plan.predicted
    lines = ["", "## What if", "",
             "The same model re-planned with one input changed; throughput is model FLOP/s per "
             "GPU, so a bigger cluster that keeps it flat scales perfectly.", "",
             "| change | layout | step time | TFLOP/s/GPU | tokens/s vs chosen |",
             "| :--- | :--- | ---: | ---: | ---: |",
             f"| (chosen plan) | tp={plan.tp} pp={plan.pp} dp={plan.dp} mbs={plan.micro_batch_size} "
             f"| {base.step_time_s:.3g} s | {base.tflops_per_gpu:.1f} | 1.00x |"]
    tokens = plan.global_batch_size / base.step_time_s
    for label, other in what_ifs.items():
        if isinstance(other, str):
            lines.append(f"| {label} | {other} | – | – | – |")
            continue
        p = other.predicted
        speed = other.global_batch_size / p.step_time_s / tokens
        lines.append(f"| {label} | tp={other.tp} pp={other.pp} dp={other.dp} "
                     f"mbs={other.micro_batch_size} | {p.step_time_s:.3g} s | "
                     f"{p.tflops_per_gpu:.1f} | {speed:.2f}x |")
    return "\n".join(lines) + "\n"
