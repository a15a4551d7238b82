"""The plan report: what was chosen, what it is predicted to cost, and why.

``write_report(plan, out_dir)`` writes ``out_dir/report.md``, plain Markdown that reads
well on GitHub and in a terminal:

1. the chosen layout (t, p, d, b, m, schedule, ZeRO stage, stage boundaries, recompute)
   and the pipeline timeline;
2. the prediction: step time, TFLOP/s per GPU, MFU/HFU, peak memory against the device;
3. where the memory goes (GiB per GPU per pipeline stage, by kind) and where the step
   time goes (seconds and % by kind);
4. which global ranks form each TP/PP/DP group, and the bytes each kind of communication
   moves;
5. why: the binding constraints and the best alternatives the search priced;
6. hand-written layouts (e.g. Megatron-LM's) priced by the same cost model, side by side;
7. what-ifs (when given): the same model re-planned with twice the nodes, H100 nodes,
   twice the global batch.

Everything here reads only the :class:`~autopar.plan.Plan`; nothing is re-solved, so a
saved plan (``Plan.from_json``) can be reported again. Charts (``timeline.png``,
``memory.png``, ``breakdown.png``, ``comparison.png``; :mod:`autopar.report.plots`) are
drawn when matplotlib is importable, and ``report.html`` (:mod:`autopar.report.html`) is
the same report, self-contained, with the charts embedded.
"""

from __future__ import annotations

from pathlib import Path

from autopar.plan import Layout, Plan

__all__ = ["render_markdown", "write_report", "write_memory_chart", "format_seconds",
           "format_bytes", "format_tflops", "format_layout", "plan_flags", "device_memory_bytes"]

GIB = 2**30
# Display order; kinds a cost model adds later are appended after these.
TIME_KINDS = ("compute", "recompute", "tp_comm", "pp_p2p", "dp_comm", "bubble", "optimizer")
MEMORY_KINDS = ("parameters", "gradients", "optimizer_states", "activations")
TIME_KIND_NOTES = {
    "compute": "forward + backward matmuls and element-wise work",
    "recompute": "forward work repeated in backward (activation recomputation)",
    "tp_comm": "tensor-parallel all-reduces / all-gathers on the critical path",
    "pp_p2p": "activations and gradients sent between pipeline stages",
    "dp_comm": "data-parallel gradient reduction not hidden behind backward",
    "bubble": "pipeline fill and drain: idle time",
    "optimizer": "optimizer step",
}


# ------------------------------------------------------------------ formatting
def format_seconds(seconds: float) -> str:
    """``12.3 s``, ``45.6 ms`` or ``7.8 µs``."""
    if seconds >= 1.0 or seconds == 0.0:
        return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def format_tflops(tflops: float) -> str:
    """TFLOP/s to one decimal, or three significant digits below 10 (tiny CPU runs)."""
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def format_bytes(num_bytes: float) -> str:
    """Binary units: ``512 B``, ``3.0 MiB``, ``71.2 GiB``, ``1.50 TiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_layout(layout: Layout | dict) -> str:
    """``tp=8 pp=16 dp=8 mbs=1 recompute=full`` (fields left to the solver are omitted)."""
    data = layout if isinstance(layout, dict) else vars(layout)
    short = {"micro_batch_size": "mbs", "zero_stage": "zero", "virtual_stages": "v",
             "sequence_parallel": "sp", "num_micro_batches": "m"}
    defaults = {"virtual_stages": 1, "sequence_parallel": False}  # omitted: noise in tables
    order = ("tp", "pp", "dp", "micro_batch_size", "num_micro_batches", "zero_stage",
             "recompute", "schedule", "virtual_stages", "sequence_parallel")
    keys = [k for k in order if k in data] + sorted(k for k in data if k not in order)
    items = [(k, data[k]) for k in keys if data[k] is not None and defaults.get(k) != data[k]]
    return " ".join(f"{short.get(k, k)}={v}" for k, v in items) or "(free)"


def plan_flags(plan: Plan) -> str:
    """The plan's layout as flags; per-layer recompute shows as ``recompute=none×90+full×6``."""
    text = format_layout(plan.layout())
    modes = plan.recompute
    if len(set(modes)) > 1:
        counts = "+".join(f"{m}×{modes.count(m)}" for m in sorted(set(modes)))
        text += f" recompute={counts}"
    return text


def device_memory_bytes(plan: Plan) -> float | None:
    """Memory of one device of the plan's cluster, or None if the cluster dict lacks it."""
    try:
        return float(plan.cluster["device"]["memory_gib"]) * GIB
    except (KeyError, TypeError, ValueError):
        return None


def _gib(num_bytes: float) -> str:
    """Bytes as GiB: one decimal, or three significant digits below 1 GiB."""
    gib = num_bytes / GIB
    return f"{gib:.1f}" if gib >= 1 else f"{gib:.3g}"


def _ordered(keys, known: tuple[str, ...]) -> list[str]:
    """Known kinds in their display order, then any others sorted."""
    keys = list(keys)
    return [k for k in known if k in keys] + sorted(k for k in keys if k not in known)


def _table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """Markdown table; ``align`` holds one of 'l'/'r' per column (default: first l, rest r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


# ------------------------------------------------------------------- sections
def _cluster_line(plan: Plan) -> str:
    """``dgx-a100: 128 nodes × 8 × NVIDIA A100-SXM4-80GB``."""
    c = plan.cluster
    device = c.get("device", {}).get("name", "?")
    nodes, per_node = c.get("nodes", "?"), c.get("gpus_per_node", "?")
    plural = "" if nodes == 1 else "s"
    return f"{c.get('name', 'cluster')}: {nodes} node{plural} × {per_node} × {device}"


def _recompute_summary(modes: list[str]) -> str:
    """``full on layers 0–95 (96/96)`` or one run per contiguous range of a mode."""
    if not modes:
        return "no transformer layers"
    if len(set(modes)) == 1:
        return f"{modes[0]} on all {len(modes)} layers"
    runs: list[tuple[str, int, int]] = []
    for i, mode in enumerate(modes):
        if runs and runs[-1][0] == mode and runs[-1][2] == i - 1:
            runs[-1] = (mode, runs[-1][1], i)
        else:
            runs.append((mode, i, i))
    parts = [f"{m} on layers {a}–{b}" if a != b else f"{m} on layer {a}" for m, a, b in runs]
    counts = ", ".join(f"{m}: {modes.count(m)}/{len(modes)}" for m in sorted(set(modes)))
    return "; ".join(parts) + f" ({counts})"


def _layout_section(plan: Plan) -> list[str]:
    """The chosen layout as a table, then the pipeline stages."""
    rows = [
        ["model", f"`{plan.model}`"],
        ["cluster", _cluster_line(plan)],
        ["GPUs N = t·p·d", f"{plan.num_gpus}"],
        ["global batch B / sequence length s", f"{plan.global_batch_size} / {plan.seq_len}"],
        ["tensor parallel t", f"{plan.tp}" + (" + sequence parallel" * plan.sequence_parallel)],
        ["pipeline parallel p", f"{plan.pp}"],
        ["data parallel d", f"{plan.dp}"],
        ["micro-batch size b", f"{plan.micro_batch_size}"],
        ["micro-batches per step m", f"{plan.num_micro_batches}"],
        ["pipeline schedule", f"{plan.schedule}" + (f" (v={plan.virtual_stages})"
                                                    if plan.virtual_stages > 1 else "")],
        ["ZeRO stage", f"{plan.zero_stage}"],
        ["activation recompute", _recompute_summary(plan.recompute)],
    ]
    lines = ["## Chosen plan", "", f"`{plan.summary()}`", ""]
    lines += _table(["setting", "value"], rows, "ll")
    return lines + _stages_section(plan)


def _stages_section(plan: Plan) -> list[str]:
    """One row per pipeline stage: its layers, recompute modes and time per micro-batch
    (interleaved: one row per model chunk, named with the rank running it; the time is
    that rank's, all its chunks)."""
    stage_time = plan.predicted.stage_time_s
    rows = []
    for i, (first, last) in enumerate(plan.stage_layers):
        modes = plan.recompute[first:last]
        rec = ", ".join(f"{m} ×{modes.count(m)}" for m in sorted(set(modes))) or "–"
        rank = i % plan.pp
        t = format_seconds(stage_time[rank]) if rank < len(stage_time) else "–"
        name = f"{i}" if plan.virtual_stages == 1 else f"chunk {i} (rank {rank})"
        rows.append([name, f"{first}–{last - 1}" if last > first else "–",
                     f"{last - first}", rec, t])
    lines = ["### Pipeline stages", "",
             "Layers are `[first, last]` inclusive; stage time is forward + backward of one "
             "micro-batch.", ""]
    return lines + _table(["stage", "layers", "count", "recompute", "stage time"], rows, "lrrlr")


def _prediction_section(plan: Plan) -> list[str]:
    """Step time, TFLOP/s, MFU/HFU, peak memory against the device, solver time."""
    p, device = plan.predicted, device_memory_bytes(plan)
    peak = format_bytes(p.peak_memory_bytes)
    if device:
        peak += f" of {format_bytes(device)} ({p.peak_memory_bytes / device:.0%} of device memory)"
    rows = [
        ["step time", format_seconds(p.step_time_s)],
        ["throughput per GPU", f"{format_tflops(p.tflops_per_gpu)} TFLOP/s"],
        ["model FLOPs utilisation (MFU)", f"{p.mfu:.1%}"],
        ["hardware FLOPs utilisation (HFU)", f"{p.hfu:.1%}"],
        ["peak memory per GPU", peak],
        ["solver time", format_seconds(p.solve_time_s)],
    ]
    return ["## Prediction", ""] + _table(["quantity", "value"], rows, "lr")


def _time_section(plan: Plan) -> list[str]:
    """Seconds and share of the step by kind (compute, recompute, communication ...)."""
    p = plan.predicted
    kinds = _ordered(p.time_s_by_kind, TIME_KINDS)
    rows = [[k, format_seconds(p.time_s_by_kind[k]),
             f"{p.time_s_by_kind[k] / p.step_time_s:.1%}" if p.step_time_s else "–",
             TIME_KIND_NOTES.get(k, "")] for k in kinds]
    lines = ["## Where the step time goes", ""]
    lines += _table(["kind", "time", "% of step", "what"], rows, "lrrl")
    total = sum(p.time_s_by_kind.values())
    if p.step_time_s and abs(total - p.step_time_s) > 0.005 * p.step_time_s:
        why = ("some of it overlaps" if total > p.step_time_s
               else "the rest is not attributed to a kind")
        lines += [f"The parts add up to {format_seconds(total)} against a step time of "
                  f"{format_seconds(p.step_time_s)} ({why}).", ""]
    return lines


def _memory_section(plan: Plan, chart: str | None) -> list[str]:
    """GiB per GPU for each stage by kind (parameters, gradients, optimizer, activations)."""
    stages = plan.predicted.memory_bytes_by_stage
    kinds = _ordered({k for stage in stages for k in stage}, MEMORY_KINDS)
    device = device_memory_bytes(plan)
    largest = max((sum(stage.values()) for stage in stages), default=0.0)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    rows = []
    for i, stage in enumerate(stages):
        total = sum(stage.values())
        row = [f"{i}"] + [f"{stage.get(k, 0.0) / scale:.2f}" for k in kinds]
        row.append(f"{total / scale:.2f}")
        rows.append(row + ([f"{total / device:.0%}"] if device else []))
    header = ["stage"] + kinds + ["total"] + (["% of device"] if device else [])
    lines = [f"## Memory per GPU by pipeline stage ({unit})", ""]
    if device:
        lines += [f"Device memory: {device / GIB:.0f} GiB.", ""]
    lines += _table(header, rows)
    return lines + ([f"![memory per stage]({chart})", ""] if chart else [])


def _comm_section(plan: Plan) -> list[str]:
    """Bytes per GPU per step by kind of communication."""
    by_kind = plan.predicted.comm_bytes_by_kind
    rows = [[k, format_bytes(by_kind[k])] for k in _ordered(by_kind, ())]
    if len(rows) > 1:
        rows.append(["**total**", format_bytes(sum(by_kind.values()))])
    lines = ["## Communication per GPU per step", "", "Payload bytes each GPU sends per step.", ""]
    return lines + (_table(["kind", "bytes"], rows) if rows else ["No communication.", ""])


def _alternative_row(alt: dict, chosen_s: float) -> list[str]:
    """One alternative layout: its step time against the chosen one, and why it lost."""
    step, feasible = alt.get("step_time_s"), alt.get("feasible", True)
    priced = isinstance(step, (int, float)) and step > 0
    ratio = f"{step / chosen_s:.2f}×" if priced and chosen_s else "–"
    peak = alt.get("peak_memory_bytes")
    if feasible is None:  # not priced, e.g. pruned by a lower bound
        outcome = alt.get("reason") or "not priced"
    elif not feasible:
        reason = alt.get("reason") or "does not fit"
        outcome = reason if reason.startswith("infeasible") else f"infeasible: {reason}"
    elif alt.get("reason") not in (None, "", "slower"):  # a specific reason from the search
        outcome = alt["reason"]
    elif priced and chosen_s and step > chosen_s * 1.0005:
        outcome = f"{step / chosen_s - 1:.1%} slower"
    else:
        outcome = "ties the chosen plan (tie broken by the search order)"
    return [format_layout(alt.get("layout", {})), format_seconds(step) if priced else "–", ratio,
            format_tflops(alt["tflops_per_gpu"]) if alt.get("tflops_per_gpu") else "–",
            format_bytes(peak) if peak else "–", outcome]


def _why_section(plan: Plan, max_alternatives: int = 12) -> list[str]:
    """Binding constraints and the best alternatives the search priced."""
    lines = ["## Why this plan", "", "### Binding constraints", ""]
    lines += [f"- {b}" for b in plan.binding] or ["- none reported: the fastest layout fits."]
    lines += [""]
    rank = {True: 0, None: 1, False: 2}  # feasible, not priced, infeasible
    alts = sorted(plan.alternatives, key=lambda a: (rank.get(a.get("feasible", True), 2),
                                                   a.get("step_time_s") or float("inf")))
    lines += ["### Best alternatives the search priced", ""]
    if not alts:
        return lines + ["The plan records no alternatives.", ""]
    rows = [_alternative_row(a, plan.predicted.step_time_s) for a in alts[:max_alternatives]]
    lines += [f"{len(rows)} of {len(alts)} shown, fastest feasible first; *vs chosen* is the "
              "alternative's step time over the chosen plan's.", ""]
    return lines + _table(["layout", "step time", "vs chosen", "TFLOP/s/GPU", "peak memory",
                           "outcome"], rows, "lrrrrl")


def _hand_row(name: str, hand: Plan | str, auto: Plan, device: float | None) -> list[str]:
    """One row of the hand-layout table (a Plan, or the reason it could not be priced)."""
    if not isinstance(hand, Plan):  # could not be priced: the reason is in the last column
        return [name, "–", "–", "–", "–", "–", "–", str(hand)]
    p = hand.predicted
    fits = "yes" if device is None or p.peak_memory_bytes <= device else "**no**"
    return [name, f"`{plan_flags(hand)}`", format_seconds(p.step_time_s),
            format_tflops(p.tflops_per_gpu), f"{p.mfu:.1%}", _gib(p.peak_memory_bytes),
            f"{auto.predicted.step_time_s / p.step_time_s:.2f}" if p.step_time_s else "–", fits]


def _hand_section(plan: Plan, hand_layouts: dict[str, Plan | str]) -> list[str]:
    """Hand-written layouts priced by the same cost model, beside the auto plan."""
    device = device_memory_bytes(plan)
    rows = [_hand_row("**autopar (this plan)**", plan, plan, device)]
    rows += [_hand_row(name, hand, plan, device) for name, hand in hand_layouts.items()]
    lines = ["## Hand-written layouts priced by the same cost model", "",
             "*auto/hand* is the auto plan's step time over the hand layout's: below 1 the "
             "auto plan is faster.", ""]
    lines += _table(["layout", "flags", "step time", "TFLOP/s/GPU", "MFU", "peak memory (GiB)",
                     "auto/hand", "fits in memory"], rows, "llrrrrrl")
    for name, hand in hand_layouts.items():
        if isinstance(hand, Plan) and hand.predicted.step_time_s:
            speedup = hand.predicted.step_time_s / plan.predicted.step_time_s
            word = "faster" if speedup >= 1 else "slower"
            lines.append(f"- against {name}: the auto plan is {max(speedup, 1 / speedup):.2f}× "
                         f"{word} ({format_seconds(plan.predicted.step_time_s)} vs "
                         f"{format_seconds(hand.predicted.step_time_s)} per step).")
    return lines + [""]


# ---------------------------------------------------------------------- public
def render_markdown(plan: Plan, hand_layouts: dict[str, Plan | str] | None = None, *,
                    title: str | None = None, memory_chart: str | None = None,
                    charts: dict[str, str] | None = None,
                    what_ifs: dict[str, Plan | str] | None = None) -> str:
    """The whole report as Markdown.

    hand_layouts: name -> a :class:`Plan` from ``autopar.evaluate`` of a hand-written layout,
        or a string saying why that layout could not be priced (e.g. the InfeasibleError text).
    title: the top heading (default: the model and cluster).
    memory_chart: relative path of a memory bar chart image to link, if one was drawn.
    charts: chart name ("timeline", "memory", "breakdown", "comparison") -> relative path
        of the image drawn by :func:`autopar.report.plots.write_charts`.
    what_ifs: label -> re-planned Plan (or why none), from
        :func:`autopar.report.whatif.what_if_plans`, rendered as a "What if" section.
    """
    from autopar.report.plots import rank_layout_section  # report_plots imports this module

    charts = charts or {}
    title = title or f"autopar plan: {plan.model} on {_cluster_line(plan)}"
    lines = [f"# {title}", ""]
    # The pictures first (timeline, memory, step time), then the rank map and the why.
    lines += _layout_section(plan) + _image("pipeline timeline", charts.get("timeline"))
    lines += _prediction_section(plan)
    lines += _memory_section(plan, memory_chart or charts.get("memory"))
    lines += _time_section(plan) + _image("step time by kind", charts.get("breakdown"))
    lines += rank_layout_section(plan) + _comm_section(plan) + _why_section(plan)
    if hand_layouts:
        lines += _hand_section(plan, hand_layouts)
        lines += _image("auto vs hand step time", charts.get("comparison"))
    if what_ifs:
        from autopar.report.whatif import what_if_markdown

        lines += what_if_markdown(plan, what_ifs).splitlines()
    lines += _formulas_section()
    return "\n".join(lines).rstrip() + "\n"


def _image(alt: str, path: str | None) -> list[str]:
    """A Markdown image paragraph, or nothing when the chart was not drawn."""
    return [f"![{alt}]({path})", ""] if path else []


def _formulas_section() -> list[str]:
    """The published closed forms the cost model is checked against (autopar.oracle.symbolic)."""
    from autopar.oracle.symbolic import formulas_markdown

    return ["", "## How the cost model is checked", "",
            "Every number above comes from one cost model (`autopar/cost.py` over "
            "`cost_models/`); these are the published formulas it reproduces, and "
            "`reports/published_vs_predicted.md` compares it with published Megatron-LM runs.",
            ""] + formulas_markdown().splitlines()


def write_memory_chart(plan: Plan, path: str | Path) -> Path | None:
    """Stacked bars of memory per stage by kind (PNG); None when matplotlib is missing."""
    from autopar.report.plots import write_memory_chart as draw  # report_plots imports this module

    return draw(plan, path)


def write_report(plan: Plan, out_dir: str | Path, *,
                 hand_layouts: dict[str, Plan | str] | None = None,
                 title: str | None = None, chart: bool = True,
                 what_ifs: dict[str, Plan | str] | None = None) -> Path:
    """Write ``out_dir/report.md`` and ``out_dir/report.html``; return the Markdown path.

    what_ifs: label -> re-planned Plan (or why none), from
    :func:`autopar.report.whatif.what_if_plans`, rendered as a "What if" section.

    With ``chart`` (and matplotlib importable) the PNG charts of
    :mod:`autopar.report.plots` are drawn beside them, linked from the Markdown and
    embedded as data URIs in the self-contained HTML.
    """
    from autopar.report.html import write_html
    from autopar.report.plots import write_charts

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = write_charts(plan, out_dir, hand_layouts) if chart else {}
    text = render_markdown(plan, hand_layouts, title=title, charts=charts, what_ifs=what_ifs)
    path = out_dir / "report.md"
    path.write_text(text, encoding="utf-8")
    write_html(text, out_dir)
    return path
