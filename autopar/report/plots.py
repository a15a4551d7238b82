"""Pictures of a plan, drawn from the plan's own numbers (the same cost model as the report).

- ``timeline.png``: the pipeline schedule the plan is priced with, one row per pipeline
  rank: forward and backward blocks per micro-batch chunk (interleaved 1F1B: v chunks per
  rank in alternating shades), the recompute at the start of each backward in its own
  colour, the point-to-point sends in grey, idle time (the bubble) as gaps. Block times are
  the cost model's per-stage forward, backward and recompute seconds
  (``Prediction.stage_phase_s``) laid out by :mod:`autopar.report.schedule`.
- ``memory.png``: memory per GPU per stage by kind, against the device memory line.
- ``breakdown.png``: the step time split by kind (``Prediction.time_s_by_kind``).
- ``comparison.png``: step time of the auto plan beside hand-written layouts.

Every drawing uses matplotlib's headless Agg backend; without matplotlib nothing is drawn
and the writers return None.
"""

from __future__ import annotations

from pathlib import Path

from autopar.contract.plan import Plan
from autopar.report.format import GIB, MEMORY_KINDS, TIME_KINDS, device_memory_bytes, ordered
from autopar.report.schedule import drawn_micro_batches, makespan_s, plan_timeline

__all__ = ["write_timeline_chart", "write_memory_chart", "write_breakdown_chart",
           "write_comparison_chart", "write_charts", "CHART_FILES", "MAX_DRAWN_MICRO",
           "TIMELINE_COLOURS", "TIMELINE_DETAIL_COLOURS", "MEMORY_COLOURS"]

# chart name -> its file in the report directory (names the report owns there)
CHART_FILES = {"timeline": "timeline.png", "memory": "memory.png",
               "breakdown": "breakdown.png", "comparison": "comparison.png"}
MAX_DRAWN_MICRO = 16  # the timeline draws about this many micro-batches at most
# Colours that only the timeline and only the memory chart use (the breakdown chart takes
# matplotlib's default cycle, the comparison green and grey), so a screenshot of the HTML
# report can tell the two charts are on screen by counting their pixels.
TIMELINE_COLOURS = {"F": "#4c72b0", "B": "#dd8452"}  # forward, backward
# the recompute part of a backward, point-to-point sends, and the lighter shades of odd
# chunks under interleaving (not counted by the screenshot test: not every plan has them)
TIMELINE_DETAIL_COLOURS = {"R": "#c44e52", "P": "#a0a0a0", "F1": "#9fb6db", "B1": "#eebf9c",
                           "W": "#55a868", "W1": "#a6d4b2",  # a split backward's weight gradient
                           "BW": "#b07aa1", "BW1": "#d7bcd0"}  # its whole backward, B then W
MEMORY_COLOURS = {"parameters": "#8172b3", "gradients": "#937860",
                  "optimizer_states": "#64b5cd", "activations": "#da8bc3"}

# --------------------------------------------------------------------- charts
def _pyplot():
    """matplotlib.pyplot on the headless Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _time_unit(seconds: float) -> tuple[str, float]:
    """A unit for an axis spanning ``seconds``: (name, seconds per unit)."""
    if seconds >= 1:
        return "s", 1.0
    return ("ms", 1e-3) if seconds >= 1e-3 else ("µs", 1e-6)


def _save(plt, fig, path: str | Path) -> Path:
    """Lay out, save as PNG and close the figure."""
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return Path(path)


def write_timeline_chart(plan: Plan, path: str | Path) -> Path | None:
    """The pipeline schedule of one step as a PNG (:func:`~autopar.report.schedule.plan_timeline`;
    the first :data:`MAX_DRAWN_MICRO` or so micro-batches when m is larger)."""
    plt = _pyplot()
    if plt is None or len(plan.predicted.stage_time_s) != plan.pp:
        return None
    m = drawn_micro_batches(plan.schedule, plan.pp, plan.num_micro_batches, MAX_DRAWN_MICRO,
                            plan.virtual_stages)
    timeline = plan_timeline(plan, m)
    unit, scale = _time_unit(makespan_s(timeline))
    fig, ax = plt.subplots(figsize=(min(14.0, 4 + 0.45 * m * 2), 0.45 * plan.pp + 1.6), dpi=100)
    for i, row in enumerate(timeline):
        for blk in row:
            _draw_block(ax, blk, i, scale)
    ax.set_yticks(range(plan.pp), [f"stage {i}" for i in range(plan.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan_s(timeline) / scale * 1.01 or 1)
    ax.set_xlabel(f"time ({unit}), the cost model's forward, backward and recompute times")
    drawn = "" if m == plan.num_micro_batches else \
        f" (drawn with the first {m} of {plan.num_micro_batches} micro-batches)"
    chunks = f", v={plan.virtual_stages} chunks per rank" if plan.virtual_stages > 1 else ""
    ax.set_title(f"{plan.schedule} pipeline, p={plan.pp}, m={plan.num_micro_batches}{chunks}"
                 f"{drawn}", fontsize=9)
    shown = {"F": "forward", "B": "backward", "W": "weight gradient",
             "BW": "whole backward (B + W)", "R": "recompute", "P": "point-to-point"}
    blocks = [blk for row in timeline for blk in row]
    kinds = {blk.kind for blk in blocks} | ({"R"} if any(b.recompute_s for b in blocks) else set()) \
        | ({"P"} if any(b.send_s for b in blocks) else set())
    colours = {**TIMELINE_COLOURS, **TIMELINE_DETAIL_COLOURS}
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in shown if k in kinds],
              [name for k, name in shown.items() if k in kinds], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(plt, fig, path)


def _draw_block(ax, blk, row: int, scale: float) -> None:
    """One block: a backward's recompute part first in its own colour, then the compute
    (odd chunks in the lighter shade), then its send; labelled with the micro-batch."""
    colours = {**TIMELINE_COLOURS, **TIMELINE_DETAIL_COLOURS}
    shade = blk.kind + ("1" if blk.chunk % 2 else "")
    start = blk.start_s
    if blk.recompute_s:
        ax.broken_barh([(start / scale, blk.recompute_s / scale)], (row - 0.4, 0.8),
                       facecolors=colours["R"], edgecolor="white", linewidth=0.5)
        start += blk.recompute_s
    ax.broken_barh([(start / scale, (blk.end_s - start) / scale)], (row - 0.4, 0.8),
                   facecolors=colours[shade], edgecolor="white", linewidth=0.5)
    if blk.send_s:
        ax.broken_barh([(blk.end_s / scale, blk.send_s / scale)], (row - 0.4, 0.8),
                       facecolors=colours["P"], linewidth=0)
    ax.text((blk.start_s + blk.end_s) / 2 / scale, row, str(blk.micro_batch), ha="center",
            va="center", fontsize=7, color="white")


def write_memory_chart(plan: Plan, path: str | Path) -> Path | None:
    """Stacked bars of memory per stage by kind (PNG); None when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    stages = plan.predicted.memory_bytes_by_stage
    kinds = ordered({k for stage in stages for k in stage}, MEMORY_KINDS)
    largest = max((sum(stage.values()) for stage in stages), default=0.0)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(stages) + 3), 3.2), dpi=100)
    bottom = [0.0] * len(stages)
    for kind in kinds:
        values = [stage.get(kind, 0.0) / scale for stage in stages]
        ax.bar(range(len(stages)), values, bottom=bottom, label=kind,
               color=MEMORY_COLOURS.get(kind))  # None: the next default colour
        bottom = [b + v for b, v in zip(bottom, values)]
    device = device_memory_bytes(plan)
    if device and device <= 4 * largest:  # the device line only where it is in scale
        ax.axhline(device / scale, color="black", linestyle="--", linewidth=1,
                   label="device memory")
    ax.set_xticks(range(len(stages)))
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(f"{unit} per GPU")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(plt, fig, path)


def write_breakdown_chart(plan: Plan, path: str | Path) -> Path | None:
    """One horizontal bar: the step time stacked by kind (compute, communication, ...)."""
    plt, by_kind = _pyplot(), plan.predicted.time_s_by_kind
    if plt is None or not by_kind:
        return None
    kinds = [k for k in ordered(by_kind, TIME_KINDS) if by_kind[k] > 0]
    unit, scale = _time_unit(max(sum(by_kind.values()), plan.predicted.step_time_s))
    fig, ax = plt.subplots(figsize=(8.0, 1.9), dpi=100)
    left = 0.0
    for kind in kinds:
        width = by_kind[kind] / scale
        ax.barh([0], [width], left=left, label=kind, height=0.6)
        left += width
    ax.axvline(plan.predicted.step_time_s / scale, color="black", linestyle="--",
               linewidth=1, label="step time")
    ax.set_yticks([])
    ax.set_xlabel(f"time per step by kind ({unit})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.05))
    return _save(plt, fig, path)


def write_comparison_chart(plan: Plan, hand_layouts: dict[str, Plan | str],
                           path: str | Path) -> Path | None:
    """Step time of the auto plan and of each hand layout that could be priced."""
    plt = _pyplot()
    priced = {name: h for name, h in hand_layouts.items() if isinstance(h, Plan)}
    if plt is None or not priced:
        return None
    names = ["autopar"] + list(priced)
    steps = [plan.predicted.step_time_s] + [h.predicted.step_time_s for h in priced.values()]
    unit, scale = _time_unit(max(steps))
    fig, ax = plt.subplots(figsize=(7.0, 0.45 * len(names) + 1.2), dpi=100)
    colours = ["#55a868"] + ["#8c8c8c"] * len(priced)
    ax.barh(range(len(names)), [s / scale for s in steps], color=colours)
    for y, s in enumerate(steps):
        ax.text(s / scale, y, f" {s / scale:.3g} {unit}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, max(steps) / scale * 1.25)
    ax.set_xlabel(f"predicted step time ({unit}), same cost model")
    return _save(plt, fig, path)


def write_charts(plan: Plan, out_dir: str | Path,
                 hand_layouts: dict[str, Plan | str] | None = None) -> dict[str, str]:
    """Draw every chart that applies into ``out_dir``; returns chart name -> file name."""
    out_dir = Path(out_dir)
    drawn = {
        "timeline": write_timeline_chart(plan, out_dir / CHART_FILES["timeline"]),
        "memory": write_memory_chart(plan, out_dir / CHART_FILES["memory"]),
        "breakdown": write_breakdown_chart(plan, out_dir / CHART_FILES["breakdown"]),
        "comparison": write_comparison_chart(plan, hand_layouts or {},
                                             out_dir / CHART_FILES["comparison"]),
    }
    return {name: path.name for name, path in drawn.items() if path is not None}
