"""Pictures of a plan, drawn from the plan's own numbers (the same cost model as the report).

- ``timeline.png``: the pipeline schedule, one row per pipeline rank, forward and backward
  blocks per micro-batch, idle time (the bubble) as gaps. Block start times come from
  :func:`simulate_schedule`, a small event simulation of GPipe or 1F1B.
- ``memory.png``: memory per GPU per stage by kind, against the device memory line.
- ``breakdown.png``: the step time split by kind (``Prediction.time_s_by_kind``).
- ``comparison.png``: step time of the auto plan beside hand-written layouts.

The cost model gives one number per stage, ``Prediction.stage_time_s[i]``: forward +
backward of one micro-batch. The timeline splits it 1 : 2 (backward = 2 × forward: the
backward computes gradients of both inputs and weights, two matmuls per forward matmul;
Narayanan et al. 2021, section 3.5). Communication between stages is not drawn.

Every drawing uses matplotlib's headless Agg backend; without matplotlib nothing is drawn
and the writers return None.
"""

from __future__ import annotations

from pathlib import Path

from autopar.plan import Plan
from autopar.report.format import GIB, MEMORY_KINDS, TIME_KINDS, device_memory_bytes, ordered

__all__ = ["simulate_schedule", "schedule_order", "write_timeline_chart", "write_memory_chart",
           "write_breakdown_chart", "write_comparison_chart", "write_charts", "MAX_DRAWN_MICRO",
           "TIMELINE_COLOURS", "MEMORY_COLOURS"]

MAX_DRAWN_MICRO = 16  # the timeline draws at most this many micro-batches
BACKWARD_OVER_FORWARD = 2.0  # backward = 2 x forward (see the module docstring)
# Colours that only the timeline and only the memory chart use (the breakdown chart takes
# matplotlib's default cycle, the comparison green and grey), so a screenshot of the HTML
# report can tell the two charts are on screen by counting their pixels.
TIMELINE_COLOURS = {"F": "#4c72b0", "B": "#dd8452"}  # forward, backward
MEMORY_COLOURS = {"parameters": "#8172b3", "gradients": "#937860",
                  "optimizer_states": "#64b5cd", "activations": "#da8bc3"}

Op = tuple[str, int, float, float]  # (kind "F"/"B", micro-batch, start s, end s)


# ------------------------------------------------------------------- schedule
def schedule_order(schedule: str, pp: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The order in which one pipeline stage runs its forwards ("F") and backwards ("B").

    GPipe: all m forwards, then all m backwards. 1F1B (PipeDream-flush, Narayanan et al.
    2021): ``p - 1 - i`` warm-up forwards on stage i, then one forward / one backward,
    then the remaining backwards (cool-down). Interleaved 1F1B is drawn as 1F1B.
    """
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if schedule not in ("1f1b", "interleaved_1f1b"):
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use 'gpipe' or '1f1b'")
    warmup = min(pp - 1 - stage, m)
    order = [("F", j) for j in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", j) for j in range(m - warmup, m)]


def simulate_schedule(schedule: str, pp: int, m: int, fwd_s: list[float],
                      bwd_s: list[float]) -> list[list[Op]]:
    """Start and end of every forward and backward on every stage, ASAP under dependencies.

    A forward of micro-batch j on stage i starts once forward j on stage i - 1 has ended
    and stage i has finished its previous op; a backward j on stage i once backward j on
    stage i + 1 (on the last stage: its own forward j) and the previous op have ended.
    Returns per stage the list of ``(kind, micro_batch, start, end)`` in run order. For
    equal stages (f, b) the makespan is ``(m + p - 1) · (f + b)`` for both schedules.
    """
    if len(fwd_s) != pp or len(bwd_s) != pp:
        raise ValueError(f"need one forward and one backward time per stage (pp={pp}), "
                         f"got {len(fwd_s)} and {len(bwd_s)}")
    orders = [schedule_order(schedule, pp, m, i) for i in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end time
    timeline: list[list[Op]] = [[] for _ in range(pp)]
    nxt, free = [0] * pp, [0.0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(pp):
            while nxt[i] < len(orders[i]):
                kind, j = orders[i][nxt[i]]
                dep = (("F", i - 1, j) if i > 0 else None) if kind == "F" else \
                    (("B", i + 1, j) if i < pp - 1 else ("F", i, j))
                if dep is not None and dep not in done:
                    break
                start = max(free[i], done[dep] if dep else 0.0)
                end = start + (fwd_s[i] if kind == "F" else bwd_s[i])
                done[(kind, i, j)], free[i] = end, end
                timeline[i].append((kind, j, start, end))
                nxt[i], remaining, progressed = nxt[i] + 1, remaining - 1, True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks with pp={pp}, m={m}")
    return timeline


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
    """The pipeline schedule of one step (first 16 micro-batches when m > 16), as a PNG."""
    plt, times = _pyplot(), plan.predicted.stage_time_s
    if plt is None or len(times) != plan.pp:
        return None
    m = min(plan.num_micro_batches, MAX_DRAWN_MICRO)
    fwd = [t / (1 + BACKWARD_OVER_FORWARD) for t in times]
    bwd = [t - f for t, f in zip(times, fwd)]
    timeline = simulate_schedule(plan.schedule, plan.pp, m, fwd, bwd)
    makespan = max((ops[-1][3] for ops in timeline if ops), default=0.0)
    unit, scale = _time_unit(makespan)
    fig, ax = plt.subplots(figsize=(min(14.0, 4 + 0.45 * m * 2), 0.45 * plan.pp + 1.6), dpi=100)
    colours = TIMELINE_COLOURS
    for i, ops in enumerate(timeline):
        for kind, j, start, end in ops:
            ax.broken_barh([(start / scale, (end - start) / scale)], (i - 0.4, 0.8),
                           facecolors=colours[kind], edgecolor="white", linewidth=0.5)
            ax.text((start + end) / 2 / scale, i, str(j), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(plan.pp), [f"stage {i}" for i in range(plan.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan / scale * 1.01 or 1)
    ax.set_xlabel(f"time ({unit}); backward = 2 × forward")
    drawn = "" if m == plan.num_micro_batches else \
        f" (drawn with the first {m} of {plan.num_micro_batches} micro-batches)"
    ax.set_title(f"{plan.schedule} pipeline, p={plan.pp}, m={plan.num_micro_batches}{drawn}",
                 fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, ["forward", "backward"], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    return _save(plt, fig, path)


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
        "timeline": write_timeline_chart(plan, out_dir / "timeline.png"),
        "memory": write_memory_chart(plan, out_dir / "memory.png"),
        "breakdown": write_breakdown_chart(plan, out_dir / "breakdown.png"),
        "comparison": write_comparison_chart(plan, hand_layouts or {},
                                             out_dir / "comparison.png"),
    }
    return {name: path.name for name, path in drawn.items() if path is not None}
