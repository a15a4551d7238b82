"""The plan report: what was chosen, what it is predicted to cost, and why.

``write_report(plan, out_dir)`` writes ``out_dir/report.md``, plain Markdown that reads
well on GitHub and in a terminal:

1. the chosen layout (t, p, d, b, m, schedule, ZeRO stage, stage boundaries, recompute)
   and the pipeline timeline;
2. the prediction: step time, TFLOP/s per GPU, MFU/HFU, peak memory against the device;
3. where the memory goes (GiB per GPU per pipeline stage, by kind) and where the step
   time goes (seconds and % by kind);
4. which global ranks form each TP/PP/DP group, and the bytes each kind of communication
   moves; the ops every TP rank runs whole (no TP strategy, or replicated by choice);
5. why: the binding constraints and the best alternatives the search priced;
6. hand-written layouts (e.g. Megatron-LM's) priced by the same cost model, side by side;
7. what-ifs (when given): the same model re-planned with twice the nodes, H100 nodes,
   twice the global batch.

Everything here reads only the :class:`~autopar.contract.plan.Plan`; nothing is re-solved, so a
saved plan (``Plan.from_json``) can be reported again. The what-if plans are made by
:func:`autopar.api.what_if_plans` and handed in. The sections are
:mod:`autopar.report.sections` (the rank map :mod:`autopar.report.ranks`), their number
formatting :mod:`autopar.report.format`; this module puts them in order. Charts
(``timeline.png``, ``memory.png``, ``breakdown.png``, ``comparison.png``;
:mod:`autopar.report.plots`) are drawn when matplotlib is importable, and ``report.html``
(:mod:`autopar.report.html`) is the same report, self-contained, with the charts embedded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from autopar.contract.plan import Plan
from autopar.report.format import cluster_line
from autopar.report.frameworks import frameworks_section
from autopar.report.html import write_html
from autopar.report.owned import owned_files, remove_stale, write_manifest
from autopar.report.plots import write_charts
from autopar.report.ranks import rank_layout_section
from autopar.report.sections import (comm_section, formulas_section, hand_section, image,
                                     layout_section, memory_section, prediction_section,
                                     replicated_section, time_section, why_section)
from autopar.report.whatif import what_if_markdown

__all__ = ["render_markdown", "write_report"]


def render_markdown(plan: Plan, hand_layouts: dict[str, Plan | str] | None = None, *,
                    title: str | None = None, memory_chart: str | None = None,
                    charts: dict[str, str] | None = None,
                    what_ifs: dict[str, Plan | str] | None = None,
                    framework_plans: dict[str, Plan | str] | None = None) -> str:
    """The whole report as Markdown.

    hand_layouts: name -> a :class:`Plan` from ``autopar.evaluate`` of a hand-written layout,
        or a string saying why that layout could not be priced (e.g. the InfeasibleError text).
    title: the top heading (default: the model and cluster).
    memory_chart: relative path of a memory bar chart image to link, if one was drawn.
    charts: chart name ("timeline", "memory", "breakdown", "comparison") -> relative path
        of the image drawn by :func:`autopar.report.plots.write_charts`.
    what_ifs: label -> re-planned Plan (or why none), from
        :func:`autopar.api.what_if_plans`, rendered as a "What if" section.
    framework_plans: framework -> the plan searched for it (``autopar.plan(...,
        target=framework)``, or why none), shown where this plan is outside its space.
    """
    charts = charts or {}
    title = title or f"autopar plan: {plan.model} on {cluster_line(plan)}"
    lines = [f"# {title}", ""]
    # The pictures first (timeline, memory, step time), then the rank map and the why.
    lines += layout_section(plan) + image("pipeline timeline", charts.get("timeline"))
    lines += prediction_section(plan)
    lines += memory_section(plan, memory_chart or charts.get("memory"))
    lines += time_section(plan) + image("step time by kind", charts.get("breakdown"))
    lines += rank_layout_section(plan) + comm_section(plan) + replicated_section(plan)
    lines += why_section(plan)
    lines += frameworks_section(plan, framework_plans)
    if hand_layouts:
        lines += hand_section(plan, hand_layouts)
        lines += image("auto vs hand step time", charts.get("comparison"))
    if what_ifs:
        lines += what_if_markdown(plan, what_ifs).splitlines()
    lines += formulas_section()
    return "\n".join(lines).rstrip() + "\n"


def write_report(plan: Plan, out_dir: str | Path, *,
                 hand_layouts: dict[str, Plan | str] | None = None,
                 title: str | None = None, chart: bool = True,
                 what_ifs: dict[str, Plan | str] | None = None,
                 framework_plans: dict[str, Plan | str] | None = None) -> Path:
    """Write ``out_dir/report.md`` and ``out_dir/report.html``; return the Markdown path.

    what_ifs: label -> re-planned Plan (or why none), from
    :func:`autopar.api.what_if_plans`, rendered as a "What if" section.
    framework_plans: framework -> ``autopar.plan(..., target=framework)`` (or why none),
    shown with its configuration where ``plan`` is outside that framework's space.

    With ``chart`` (and matplotlib importable) the PNG charts of
    :mod:`autopar.report.plots` are drawn beside them, linked from the Markdown and
    embedded as data URIs in the self-contained HTML. The files written are recorded in
    ``out_dir/.autopar-report.json``; those an earlier report there wrote and this one
    did not (a chart it no longer draws) are removed, other files are left alone
    (:mod:`autopar.report.owned`).
    """
    out_dir = Path(out_dir)
    extra = dict(title=title, what_ifs=what_ifs, framework_plans=framework_plans)
    text = render_markdown(plan, hand_layouts, **extra)  # fails first
    created = _make_dir(out_dir)
    earlier = owned_files(out_dir)  # an older report's files here (autopar.report.owned)
    try:
        charts = write_charts(plan, out_dir, hand_layouts) if chart else {}
        text = render_markdown(plan, hand_layouts, charts=charts, **extra)
        path = out_dir / "report.md"
        path.write_text(text, encoding="utf-8")
        written = {path.name, write_html(text, out_dir).name, *charts.values()}
        write_manifest(out_dir, written)
    except BaseException:  # no half-written report: remove what this call created
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    remove_stale(out_dir, earlier, written)  # e.g. a comparison.png of a report before
    return path


def _make_dir(out_dir: Path) -> Path | None:
    """Create ``out_dir`` (and missing parents); returns the top folder this created (None
    when it existed). ValueError naming the path when it is a file or cannot be created."""
    top = None
    for folder in [out_dir, *out_dir.parents]:
        if folder.exists():
            break
        top = folder
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"report directory {out_dir} is a file; give a directory path")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create report directory {out_dir} ({exc.strerror or exc}); "
                         "give a directory path you can write") from None
    return top
