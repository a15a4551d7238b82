"""Plain-text and JSON views for the command line: a plan's table, ``autopar compare``
and a measured profile (``autopar calibrate``).

``compare(auto, hand)`` puts the solver's plan beside hand-written layouts priced by the
same cost model (``autopar.evaluate``), so every difference is the cost model's own:
step time, TFLOP/s per GPU, MFU, peak memory per pipeline stage, the ratio auto/hand of
step times, and where the difference comes from, per kind of
:attr:`~autopar.contract.plan.Prediction.time_s_by_kind` (compute, recompute, tp_comm, pp_p2p,
dp_comm, bubble, optimizer). Those kinds add up to the step time (``autopar.planner.costs.predict``:
step = m·(slowest stage + send) + bubble + DP reduction + optimizer), so the per-kind
differences add up to the difference of step times; any remainder is shown as "other".
"""

from __future__ import annotations

import re
from pathlib import Path

from autopar.contract.plan import Plan, format_share
from autopar.contract.plan_memory import binding_stage
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.report.format import (GIB, TIME_KINDS, format_bytes, format_seconds,
                                   format_tflops, plan_flags)

__all__ = ["plan_table", "comparison_lines", "plan_metrics", "compare", "format_compare",
           "profile_lines", "report_summary"]

_EPS_S = 1e-9


def plan_table(plan: Plan) -> str:
    """A short plain-text table of the plan's layout and prediction."""
    p = plan.predicted
    counts = [last - first for first, last in plan.stage_layers]
    stages = (f"{len(counts)} × {counts[0]} layers" if len(set(counts)) == 1
              else " + ".join(map(str, counts)) + " layers")
    if plan.virtual_stages > 1:  # stage_layers lists pp·v chunks, placed by the schedule
        placed = "a V" if pipeline_schedule(plan.schedule).placement == "v" else "interleaved"
        stages = f"{plan.pp} × {plan.virtual_stages} chunks of {counts[0]} layers ({placed})"
    device = plan.cluster.get("device", {}).get("memory_gib")
    peak = format_bytes(p.peak_memory_bytes) + (f" of {device:g} GiB" if device else "")
    if device and p.memory_reserve_bytes_by_stage:
        reserve = p.memory_reserve_bytes_by_stage[binding_stage(p, device * GIB)]
        peak += (f"; reserve {format_bytes(sum(reserve.values()))}, margin "
                 f"{format_bytes(p.memory_margin_bytes)}")
    time_parts = sorted(p.time_s_by_kind.items(), key=lambda kv: -kv[1])
    rows = [("layout", plan_flags(plan)),
            ("micro-batches m", str(plan.num_micro_batches)),
            ("pipeline stages", stages), ("step time", format_seconds(p.step_time_s)),
            ("TFLOP/s per GPU", format_tflops(p.tflops_per_gpu)),
            ("MFU / HFU", f"{p.mfu:.1%} / {p.hfu:.1%}"),
            ("peak memory", peak),
            ("solver", f"{plan.solver.status}, {format_seconds(plan.solve_wall_s)}"
                       + (f", gap {plan.solver.gap:.1%}" if plan.solver.status == "FEASIBLE" else "")),
            ("time by kind", ", ".join(f"{k} {format_seconds(v)}" for k, v in time_parts if v > 0))]
    rep = plan.replicated_ops
    if rep is not None and plan.tp > 1 and rep.chosen:  # the summary lists those with no strategy
        names = ", ".join(f"{name} ({count})" for name, count, _ in rep.by_op(rep.chosen)[:6])
        share = format_share(sum(r.share for r in rep.chosen))
        rows.append(("replicated", f"by choice: {len(rep.chosen)} ops, {share} of FLOPs: {names}"))
    return "\n".join(f"  {k:<16} {v}" for k, v in rows)


def comparison_lines(plan: Plan, hand: dict[str, Plan | str]) -> list[str]:
    """One line per hand layout: its step time and the auto/hand ratio."""
    lines = []
    for name, other in hand.items():
        if isinstance(other, Plan):
            ratio = plan.predicted.step_time_s / other.predicted.step_time_s
            pred = other.predicted
            lines.append(f"  {name}: step {format_seconds(pred.step_time_s)}, "
                         f"{format_tflops(pred.tflops_per_gpu)} TFLOP/s/GPU; "
                         f"auto/hand step time {ratio:.2f}")
        else:
            lines.append(f"  {name}: {other}")
    return lines


# -------------------------------------------------------------------------- compare
def plan_metrics(plan: Plan) -> dict:
    """What ``compare`` reports for one plan (JSON-able): layout flags, step time,
    TFLOP/s per GPU, MFU/HFU, peak memory, total memory per stage, the memory margin (device
    less reserve less peak), time by kind."""
    p = plan.predicted
    return {"layout": plan_flags(plan), "num_gpus": plan.num_gpus,
            "num_micro_batches": plan.num_micro_batches, "step_time_s": p.step_time_s,
            "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu, "hfu": p.hfu,
            "peak_memory_bytes": p.peak_memory_bytes,
            "memory_bytes_by_stage": [sum(stage.values()) for stage in p.memory_bytes_by_stage],
            "memory_margin_bytes": p.memory_margin_bytes,
            "time_s_by_kind": dict(p.time_s_by_kind)}


def report_summary(plan: Plan, markdown_path: Path) -> dict:
    """What ``autopar report --json`` prints (JSON-able): the written files (report.md,
    report.html, every image the Markdown links, as paths) and the plan's headline numbers
    (tp, pp, dp, micro_batch_size and :func:`plan_metrics`)."""
    markdown_path = Path(markdown_path)
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown_path.read_text(encoding="utf-8"))
    files = {"markdown": str(markdown_path), "html": str(markdown_path.with_suffix(".html")),
             "images": [str(markdown_path.parent / name) for name in links]}
    return {"files": files, "model": plan.model, "cluster": plan.cluster.get("name"),
            "plan": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp,
                     "micro_batch_size": plan.micro_batch_size, **plan_metrics(plan)}}


def _difference(auto: Plan, hand: Plan) -> dict[str, float]:
    """auto − hand seconds per step, per kind of time, largest first; "other" holds what
    the kinds do not account for (zero when they add up to the step time)."""
    a, h = auto.predicted.time_s_by_kind, hand.predicted.time_s_by_kind
    kinds = [k for k in TIME_KINDS if k in a or k in h] + sorted((set(a) | set(h)) - set(TIME_KINDS))
    diff = {k: a.get(k, 0.0) - h.get(k, 0.0) for k in kinds}
    rest = auto.predicted.step_time_s - hand.predicted.step_time_s - sum(diff.values())
    if abs(rest) > 1e-6 * max(auto.predicted.step_time_s, hand.predicted.step_time_s):
        diff["other"] = rest
    return dict(sorted(((k, v) for k, v in diff.items() if abs(v) > _EPS_S),
                       key=lambda kv: -abs(kv[1])))


def compare(auto: Plan, hand: dict[str, Plan | str]) -> dict:
    """The auto plan beside each hand layout (a Plan, or the reason it could not be
    priced): metrics, auto/hand step-time ratio and the per-kind difference. JSON-able."""
    rows = []
    for name, other in hand.items():
        if not isinstance(other, Plan):
            rows.append({"name": name, "error": str(other)})
            continue
        rows.append({"name": name, **plan_metrics(other),
                     "auto_over_hand": auto.predicted.step_time_s / other.predicted.step_time_s,
                     "difference_s_by_kind": _difference(auto, other),
                     "difference_s": auto.predicted.step_time_s - other.predicted.step_time_s})
    return {"model": auto.model, "cluster": auto.cluster.get("name"),
            "num_gpus": auto.num_gpus, "global_batch_size": auto.global_batch_size,
            "seq_len": auto.seq_len, "auto": plan_metrics(auto), "hand": rows}


def _stages_text(totals: list[float]) -> str:
    """Total memory per stage: every stage up to 4, else the largest and smallest."""
    if len(totals) <= 4:
        return " / ".join(f"{x / GIB:.1f}" for x in totals) + " GiB"
    hi = max(range(len(totals)), key=totals.__getitem__)
    lo = min(range(len(totals)), key=totals.__getitem__)
    return f"max {totals[hi] / GIB:.1f} GiB (stage {hi}), min {totals[lo] / GIB:.1f} GiB (stage {lo})"


def _cells(m: dict, row: dict | None) -> list[str]:
    """One plan's cells in the metrics table (the auto plan has no ``row``)."""
    ratio = "—" if row is None else f"{row['auto_over_hand']:.3f}"
    return [format_seconds(m["step_time_s"]), format_tflops(m["tflops_per_gpu"]),
            f"{m['mfu']:.1%} / {m['hfu']:.1%}", format_bytes(m["peak_memory_bytes"]),
            format_bytes(m["memory_margin_bytes"]), _stages_text(m["memory_bytes_by_stage"]), ratio]


def _explain(row: dict, tag: str) -> list[str]:
    """Where one hand layout's step time differs from the auto plan's."""
    delta = row["difference_s"]
    verdict = "faster" if delta < 0 else "slower"
    lines = [f"{tag}: auto is {format_seconds(abs(delta))} {verdict} per step than "
             f"{row['name']} ({row['auto_over_hand']:.3f}×); auto − hand by kind:"]
    for kind, diff in row["difference_s_by_kind"].items():
        sign = "-" if diff < 0 else "+"
        lines.append(f"    {kind:<10} {sign}{format_seconds(abs(diff))}")
    return lines


def format_compare(result: dict) -> str:
    """The comparison as text: the layouts, a metrics table (one row per plan), then
    where each hand layout's step time differs from the auto plan's, per kind."""
    lines = [f"{result['model']} on {result['cluster']} ({result['num_gpus']} GPUs), "
             f"B={result['global_batch_size']}, s={result['seq_len']}; one cost model for all",
             f"  auto    {result['auto']['layout']}  (the solver's plan)"]
    table = [["plan", "step time", "TFLOP/s/GPU", "MFU / HFU", "peak memory",
              "margin", "memory per stage", "auto/hand"], ["auto", *_cells(result["auto"], None)]]
    for i, row in enumerate(result["hand"], 1):
        tag = f"hand {i}"
        if "error" in row:
            lines.append(f"  {tag:<7} {row['name']}: cannot be priced: {row['error']}")
            continue
        lines.append(f"  {tag:<7} {row['layout']}  ({row['name']})")
        table.append([tag, *_cells(row, row)])
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    lines.append("")
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    lines += ["", "where the difference comes from (seconds per step):"]
    for i, row in enumerate(result["hand"], 1):
        if "error" not in row:
            lines += ["  " + line for line in _explain(row, f"hand {i}")]
    return "\n".join(lines)


# ------------------------------------------------------------------------ calibrate
def profile_lines(profile: dict, prefix: str = "") -> list[str]:
    """The numbers of a measured cluster profile, one ``key value`` line each: plain numbers
    and ``{"value": x, "source": ...}`` entries, nested keys dotted; notes are skipped."""
    lines = []
    for key, value in profile.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and "value" in value:
            value = value["value"]
        if isinstance(value, dict) and key != "notes":
            lines += profile_lines(value, f"{name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            lines.append(f"  {name:<32} {value:.4g}")
    return lines
