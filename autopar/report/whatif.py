"""What-ifs for a plan report: the same model re-planned on changed inputs.

``what_if_plans`` re-runs ``autopar.plan`` with twice the nodes, H100 instead of A100
nodes (same count) and twice the global batch; ``what_if_markdown`` renders the results
as a report section. Each entry is a Plan or a string saying why it has none (e.g. no
plan fits).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from autopar.plan import Layout, Plan

__all__ = ["what_if_plans", "what_if_markdown"]


def what_if_plans(model, cluster, plan: Plan, *, layout: Layout | None = None,
                  progress: Callable[[str], Callable | None] | None = None
                  ) -> dict[str, Plan | str]:
    """Re-plan ``model`` for three changed inputs: three more searches, each about as long
    as the one that found ``plan`` (seconds to a minute for big models).

    layout: the fields the user pinned, kept pinned in every what-if (a pin that no longer
        fits, e.g. dp with twice the nodes, makes that what-if a "no plan: ..." string).
    progress: ``progress(label)`` returns the ``autopar.plan`` progress callback for the
        what-if named ``label`` (or None for no display).
    Returns label -> Plan, or the reason there is none (InfeasibleError or ValueError text).
    """
    from cost_models.hardware import Cluster

    from autopar.api import plan as solve
    from autopar.planner.cpsat import InfeasibleError

    cases = {"twice the nodes": (dataclasses.replace(cluster, nodes=2 * cluster.nodes),
                                 plan.global_batch_size),
             "twice the global batch": (cluster, 2 * plan.global_batch_size)}
    if "A100" in cluster.device.name:
        cases["H100 nodes instead of A100"] = (Cluster.dgx_h100(nodes=cluster.nodes),
                                               plan.global_batch_size)
    out: dict[str, Plan | str] = {}
    for label, (new_cluster, batch) in cases.items():
        try:
            out[label] = solve(model, new_cluster, global_batch_size=batch, seq_len=plan.seq_len,
                               layout=layout, model_name=plan.model,
                               progress=progress(f"what if {label}") if progress else None)
        except (InfeasibleError, ValueError) as exc:
            out[label] = f"no plan: {exc}"
    return out


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
