"""Regenerate the example plan reports checked in under reports/.

    python examples/make_reports.py

Each report is the auto plan beside a hand-written Megatron-LM layout priced by the same
cost model: GPT-3 175B on 128 DGX A100 nodes (Narayanan et al. 2021: t=8, p=16, d=8, b=1,
full recompute), a 1T-parameter GPT on 384 nodes (the same paper's Table 1 row: t=8, p=64,
d=6, b=1), and a 1.3B GPT on one node (plain data parallelism, b=4), each with what-ifs
(twice the nodes, H100 nodes, twice the batch) and, for each of Megatron-LM, torchtitan and
DeepSpeed that cannot run the plan as it is, the best plan that framework runs
(``autopar.plan(..., target=)``). Each directory also holds the plans as JSON (plan.json,
plan-<framework>.json). A few minutes on two CPU cores; nothing is allocated (models are
built on the meta device).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import autopar
except ModuleNotFoundError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import autopar
import autopar.frameworks
from autopar.api import what_if_plans

ROOT = Path(__file__).resolve().parents[1] / "reports"

CASES = (
    # (directory, model, nodes, global batch, seq len, hand-written layout)
    ("gpt3-175b-dgx-a100-128", "gpt3-175b", 128, 1536, 2048, "tp=8,pp=16,dp=8,mbs=1,recompute=full"),
    ("gpt-1t-dgx-a100-384", "gpt-1t", 384, 3072, 2048, "tp=8,pp=64,dp=6,mbs=1,recompute=full"),
    ("gpt-1.3b-dgx-a100-1", "gpt-1.3b", 1, 512, 2048, "tp=1,pp=1,dp=8,mbs=4,recompute=full"),
)


def write_example(directory: str, name: str, nodes: int, batch: int, seq: int, hand: str,
                  out_root: Path = ROOT):
    """Plan ``name`` on ``nodes`` DGX A100 nodes, price the hand layout, add what-ifs and
    write ``<out_root>/<directory>`` (default ``reports/<directory>``).
    Returns (auto plan, hand plan, report.md path)."""
    model, _ = autopar.load_model(name)
    cluster = autopar.Cluster.dgx_a100(nodes=nodes)
    plan = autopar.plan(model, cluster, global_batch_size=batch, seq_len=seq, model_name=name)
    megatron = autopar.evaluate(model, cluster, autopar.Layout.parse(hand),
                                global_batch_size=batch, seq_len=seq, model_name=name)
    targets = {}  # the best plan each framework runs, where this plan is outside its space
    for framework in autopar.frameworks.FRAMEWORKS:
        if autopar.frameworks.model_problem(plan.model_config, framework):
            continue  # it would train another model: the report says why
        if autopar.frameworks.outside_target(plan, framework):
            targets[framework] = autopar.plan(model, cluster, global_batch_size=batch,
                                              seq_len=seq, model_name=name, target=framework)
    out = Path(out_root) / directory
    path = autopar.report.write_report(
        plan, out, hand_layouts={f"Megatron-LM `{hand}`": megatron},
        title=f"{name} on {nodes} DGX A100 node{'s' if nodes > 1 else ''}",
        what_ifs=what_if_plans(model, cluster, plan), framework_plans=targets)
    (out / "plan.json").write_text(plan.to_json() + "\n", encoding="utf-8")
    for framework, target_plan in targets.items():
        (out / f"plan-{framework}.json").write_text(target_plan.to_json() + "\n",
                                                    encoding="utf-8")
    return plan, megatron, path


def main() -> None:
    """Regenerate every example report under reports/ and print one line per report."""
    for case in CASES:
        plan, megatron, path = write_example(*case)
        ratio = plan.predicted.step_time_s / megatron.predicted.step_time_s
        print(f"{path}: {plan.headline()} | auto/Megatron step time {ratio:.2f}")


if __name__ == "__main__":
    main()
