"""The sections of the plan report, each a list of Markdown lines read off the Plan.

In report order: the chosen layout and its pipeline stages, the prediction (step time,
TFLOP/s per GPU, MFU/HFU, peak memory), memory per GPU per stage by kind, step time by
kind, communication bytes per GPU, the ops every TP rank runs whole, why this plan (binding
constraints, the alternatives the search priced), hand-written layouts priced by the same
cost model, and the published closed forms the cost model reproduces. The rank map is
:mod:`autopar.report.ranks`, the what-ifs :mod:`autopar.report.whatif`;
:mod:`autopar.report.document` puts them together.
Nothing here solves or prices anything.
"""

from __future__ import annotations


from autopar.techniques.recompute_modes import recompute_mode
from autopar.techniques.tensor_parallel import tensor_parallel_mode
from autopar.techniques.zero_stages import zero_stage
from autopar.contract.plan import Alternative, Plan, ReplicatedOp, ReplicatedOps, format_share
from autopar.contract.plan_memory import binding_stage, reserve_parts
from autopar.report.format import (GIB, MEMORY_KINDS, TIME_KIND_NOTES, TIME_KINDS, cluster_line,
                                   device_memory_bytes, format_bytes, format_gib, format_layout,
                                   format_seconds, format_tflops, ordered, plan_flags)
from autopar.report.formulas import FORMULAS_MARKDOWN
from autopar.report.schedule import plan_phases
from autopar.techniques.pipeline_schedules import default_schedule, pipeline_schedule

__all__ = ["layout_section", "prediction_section", "memory_section", "time_section",
           "comm_section", "replicated_section", "why_section", "hand_section", "formulas_section",
           "image"]


def _table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """Markdown table; ``align`` holds one of 'l'/'r' per column (default: first l, rest r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _recompute_summary(modes: list[str]) -> str:
    """``full (the whole layer recomputed) on all 96 layers`` (the mode's record names it)
    or one run per contiguous range of a mode."""
    if not modes:
        return "no transformer layers"
    if len(set(modes)) == 1:
        return f"{recompute_mode(modes[0]).title} on all {len(modes)} layers"
    runs: list[tuple[str, int, int]] = []
    for i, mode in enumerate(modes):
        if runs and runs[-1][0] == mode and runs[-1][2] == i - 1:
            runs[-1] = (mode, runs[-1][1], i)
        else:
            runs.append((mode, i, i))
    parts = [f"{m} on layers {a}–{b}" if a != b else f"{m} on layer {a}" for m, a, b in runs]
    counts = ", ".join(f"{m}: {modes.count(m)}/{len(modes)}" for m in sorted(set(modes)))
    return "; ".join(parts) + f" ({counts})"


def layout_section(plan: Plan) -> list[str]:
    """The chosen layout as a table, then the pipeline stages."""
    rows = [
        ["model", f"`{plan.model}`"],
        ["cluster", cluster_line(plan)],
        ["GPUs N = t·c·p·d" if plan.cp > 1 else "GPUs N = t·p·d", f"{plan.num_gpus}"],
        ["global batch B / sequence length s", f"{plan.global_batch_size} / {plan.seq_len}"],
        ["tensor parallel t", f"{plan.tp}" + tensor_parallel_mode(plan.sequence_parallel).title],
        *([["context parallel c", f"{plan.cp} (each sequence split over c ranks)"]]
          if plan.cp > 1 else []),
        ["pipeline parallel p", f"{plan.pp}"],
        ["data parallel d", f"{plan.dp}"],
        ["micro-batch size b", f"{plan.micro_batch_size}"],
        ["micro-batches per step m", f"{plan.num_micro_batches}"],
        ["pipeline schedule", f"{plan.schedule}" + (f" (v={plan.virtual_stages})"
                                                    if plan.virtual_stages > 1 else "")],
        ["ZeRO stage", zero_stage(plan.zero_stage).title],
        ["activation recompute", _recompute_summary(plan.recompute)],
    ]
    lines = ["## Chosen plan", "", f"`{plan.headline()}`", ""]
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
        rank = pipeline_schedule(plan.schedule).chunk_rank(i, plan.pp, len(plan.stage_layers))
        t = format_seconds(stage_time[rank]) if rank < len(stage_time) else "–"
        name = f"{i}" if plan.virtual_stages == 1 else f"chunk {i} (rank {rank})"
        rows.append([name, f"{first}–{last - 1}" if last > first else "–",
                     f"{last - first}", rec, t])
    lines = ["### Pipeline stages", "",
             "Layers are `[first, last]` inclusive; stage time is forward + backward of one "
             "micro-batch.", ""]
    return lines + _table(["stage", "layers", "count", "recompute", "stage time"], rows, "lrrlr")


def prediction_section(plan: Plan) -> list[str]:
    """Step time, TFLOP/s, MFU/HFU, peak memory against the device, and what the solver
    proved (a FEASIBLE plan, stopped at the time limit, says so with its gap)."""
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
        *_reserve_rows(plan, device),
        ["solver", {"OPTIMAL": "OPTIMAL", "EVALUATED": "EVALUATED (hand layout, no search)"}.get(
            plan.solver.status,
            f"{plan.solver.status} (time limit hit, gap {plan.solver.gap:.1%})")],
    ]
    lines = ["## Prediction", ""] + _table(["quantity", "value"], rows, "lr")
    if plan.solver.status == "FEASIBLE":  # say so where the numbers are read
        lines += [f"**Not proven optimal.** {plan.solver.line().split(': ', 2)[-1]}.", ""]
    return lines


def _reserve_rows(plan: Plan, device: float | None) -> list[list[str]]:
    """The reserve of the stage with the least margin, and the margin (none without a
    device size or a reserve)."""
    p = plan.predicted
    if not device or not p.memory_reserve_bytes_by_stage:
        return []
    i = binding_stage(p, device)
    reserve = p.memory_reserve_bytes_by_stage[i]
    return [["memory reserve per GPU", f"{format_bytes(sum(reserve.values()))} (stage {i}: "
                                       f"{reserve_parts(reserve, shown=3)})"],
            ["memory margin per GPU", f"{format_bytes(p.memory_margin_bytes)} (device − reserve "
                                      "− peak)"]]


def time_section(plan: Plan) -> list[str]:
    """Seconds and share of the step by kind (compute, recompute, communication ...)."""
    p = plan.predicted
    kinds = ordered(p.time_s_by_kind, TIME_KINDS)
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


def memory_section(plan: Plan, chart: str | None) -> list[str]:
    """GiB per GPU for each stage by kind (parameters, gradients, optimizer, activations),
    with the reserve and the margin against the device."""
    stages = plan.predicted.memory_bytes_by_stage
    kinds = ordered({k for stage in stages for k in stage}, MEMORY_KINDS)
    device = device_memory_bytes(plan)
    reserves = plan.predicted.memory_reserve_bytes_by_stage if device else []
    largest = max((sum(stage.values()) for stage in stages), default=0.0)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    rows = []
    for i, stage in enumerate(stages):
        total = sum(stage.values())
        row = [f"{i}"] + [f"{stage.get(k, 0.0) / scale:.2f}" for k in kinds]
        row.append(f"{total / scale:.2f}")
        if reserves:
            reserve = sum(reserves[i].values())
            row += [f"{reserve / scale:.2f}", f"{(device - reserve - total) / scale:.2f}"]
        rows.append(row + ([f"{total / device:.0%}"] if device else []))
    header = ["stage"] + kinds + ["total"] + (["reserve", "margin"] if reserves else []) \
        + (["% of device"] if device else [])
    lines = [f"## Memory per GPU by pipeline stage ({unit})", ""]
    if device:
        lines += [f"Device memory: {device / GIB:.0f} GiB.", ""]
    if reserves:
        i = binding_stage(plan.predicted, device)
        lines += [f"*reserve* is what each process holds besides the model states and "
                  f"activations (CUDA context, NCCL buffers, the step's temporaries, allocator "
                  f"fragmentation, the user's headroom); *margin* = device − reserve − total. "
                  f"Least margin: stage {i}, {format_bytes(plan.predicted.memory_margin_bytes)}; "
                  f"its reserve: {reserve_parts(reserves[i], shown=7)}.", ""]
    lines += _table(header, rows)
    return lines + ([f"![memory per stage]({chart})", ""] if chart else [])


def comm_section(plan: Plan) -> list[str]:
    """Bytes per GPU per step by kind of communication."""
    by_kind = dict(plan.predicted.comm_bytes_by_kind)
    if plan.ep == 1:  # no expert parallelism: no all-to-all to show
        by_kind.pop("ep_all_to_all", None)
    if plan.cp == 1:  # no context parallelism: no K/V all-gathers
        by_kind.pop("cp_all_gather", None), by_kind.pop("cp_reduce_scatter", None)
    rows = [[k, format_bytes(by_kind[k])] for k in ordered(by_kind, ())]
    if len(rows) > 1:
        rows.append(["**total**", format_bytes(sum(by_kind.values()))])
    lines = ["## Communication per GPU per step", "", "Payload bytes each GPU sends per step.", ""]
    return lines + (_table(["kind", "bytes"], rows) if rows else ["No communication.", ""])


def _where(ops: list[ReplicatedOp]) -> str:
    """Where ops sit: "before the first layer", "layers 0–95", "after the last layer"."""
    layers = sorted({r.layer for r in ops if r.section == "layer" and r.layer is not None})
    parts = ["before the first layer"] if any(r.section == "pre" for r in ops) else []
    if layers:
        contiguous = layers[-1] - layers[0] + 1 == len(layers)
        parts.append(f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}–"
                     f"{layers[-1]}" if contiguous else f"{len(layers)} layers")
    if any(r.section == "post" for r in ops):
        parts.append("after the last layer")
    return ", ".join(parts)


def _flops_text(flops: float) -> str:
    """``512 FLOP``, ``262 kFLOP``, ``1.07 GFLOP`` (three significant digits)."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}FLOP"
    return f"{flops:.0f} FLOP"


def _replicated_table(ops: list[ReplicatedOp]) -> list[str]:
    """One row per op name: count, where, forward FLOPs per sequence, share, notes."""
    rows = []
    for name, count, share in ReplicatedOps.by_op(ops):
        mine = [r for r in ops if r.op == name]
        notes = sorted({r.reason for r in mine if r.reason != "chosen by the solver"})
        once = sum(not r.per_sequence for r in mine)  # e.g. a causal mask: not per sequence
        if once:
            notes.append("once per micro-batch" if once == count else
                         f"{once} of them once per micro-batch")
        rows.append([f"`{name}`", f"{count}", _where(mine),
                     _flops_text(sum(r.flops for r in mine)), format_share(share),
                     "; ".join(notes)])
    return _table(["op", "count", "where", "forward per sequence", "share of FLOPs", "note"],
                  rows, "lrlrrl")


def replicated_section(plan: Plan) -> list[str]:
    """The compute ops every TP rank runs whole: those with no tensor-parallel strategy,
    then (tp > 1) those the solver replicated although a split existed."""
    rep = plan.replicated_ops
    lines = ["## Ops every tensor-parallel rank runs whole", ""]
    if rep is None:
        return lines + ["This plan was saved before autopar recorded them; re-plan to list "
                        "them.", ""]
    t = rep.tp
    lines += [f"Replication is always correct: each of the t ranks runs the op on the whole "
              f"tensor, so its work is not divided by t, and an input that arrives sharded is "
              f"all-gathered first. Shares are of the model's forward FLOPs per sequence "
              f"({_flops_text(rep.model_flops)}); an op autopar has no rule for counts one "
              "FLOP per output element.", ""]
    if plan.tp == 1:
        lines += [f"This plan has no tensor parallelism (t = 1); the ops below are those "
                  f"that would have no strategy at t = {t}.", ""]
    lines += [f"### No tensor-parallel strategy at t = {t}", ""]
    if rep.no_strategy:
        total = format_share(sum(r.share for r in rep.no_strategy))
        lines += [f"{len(rep.no_strategy)} ops, {total} of the FLOPs.", ""]
        lines += _replicated_table(rep.no_strategy)
    else:
        lines += ["Every compute op has a tensor-parallel strategy.", ""]
    if plan.tp > 1:
        lines += ["### Replicated by choice", ""]
        if rep.chosen:
            total = format_share(sum(r.share for r in rep.chosen))
            lines += [f"These {len(rep.chosen)} ops ({total} of the FLOPs) had a sharded "
                      "strategy; the solver's cheapest plan keeps them whole.", ""]
            lines += _replicated_table(rep.chosen)
        else:
            lines += ["None: every op that could be split is split.", ""]
    return lines


def _alternative_row(alt: Alternative, chosen_s: float) -> list[str]:
    """One alternative layout: its step time against the chosen one, and why it lost."""
    step, feasible, reason = alt.step_time_s, alt.feasible, alt.reason
    priced = isinstance(step, (int, float)) and step > 0
    ratio = f"{step / chosen_s:.2f}×" if priced and chosen_s else "–"
    if feasible is None:  # not priced, e.g. pruned by a lower bound
        outcome = reason or "not priced"
    elif not feasible:
        reason = reason or "does not fit"
        outcome = reason if reason.startswith("infeasible") else f"infeasible: {reason}"
    elif priced and chosen_s and reason.startswith("slower ("):  # not proven optimal
        outcome = f"{step / chosen_s - 1:.1%} {reason}"
    elif reason not in ("", "slower"):  # a specific reason from the search
        outcome = reason
    elif priced and chosen_s and step > chosen_s * 1.0005:
        outcome = f"{step / chosen_s - 1:.1%} slower"
    else:
        outcome = "ties the chosen plan (tie broken by the search order)"
    return [format_layout(alt.layout), format_seconds(step) if priced else "–", ratio,
            format_tflops(alt.tflops_per_gpu) if alt.tflops_per_gpu else "–",
            format_bytes(alt.peak_memory_bytes) if alt.peak_memory_bytes else "–", outcome]


def _schedule_lines(plan: Plan) -> list[str]:
    """Why the pipeline schedule pays, from the plan's own phases: the bubble and, for a
    split backward, the seconds its weight gradients take out of the fill and drain of the
    unsplit schedule on the same chunks (1F1B, or interleaved 1F1B for a V; Qi et al.
    2024, sections 3.1 and 6)."""
    record = pipeline_schedule(plan.schedule)
    if plan.pp == 1:
        return []
    bubble = plan.predicted.time_s_by_kind.get("bubble", 0.0)
    text = (f"- {record.title} ({record.source}): the pipeline idles {format_seconds(bubble)} "
            "per step in its fill and drain")
    weights = [s.get("weight_grad") for s in plan.predicted.stage_phase_s]
    if record.split_backward and weights and None not in weights:
        fwd, bwd, rec, c = plan_phases(plan)
        stage_s = [f + b + r for f, b, r in zip(fwd, bwd, rec)]
        m, v = plan.num_micro_batches, plan.virtual_stages
        unsplit = default_schedule(v)
        saved = unsplit.step_time_s(stage_s, m, v, c) - record.step_time_s(
            stage_s, m, v, c, weight_grad_s=weights, forward_s=fwd)
        if record.placement == "v":
            text += ("; rank i runs model chunks i and 2p - 1 - i (a V: the first rank holds "
                     "the embedding and the head)")
        text += (f"; it runs each backward as B (input gradient) then W (weight gradient, "
                 f"{format_seconds(max(weights))} per micro-batch on the busiest stage), and "
                 f"the W's fill {format_seconds(saved)} of the fill and drain that "
                 f"{unsplit.title} would leave idle, at 1F1B's memory")
    return ["### Pipeline schedule", "", text + ".", ""]


def why_section(plan: Plan, max_alternatives: int = 12) -> list[str]:
    """Binding constraints, why the pipeline schedule pays (pp > 1) and the best
    alternatives the search priced."""
    lines = ["## Why this plan", "", "### Binding constraints", ""]
    lines += [f"- {b}" for b in plan.binding] or ["- none reported: the fastest layout fits."]
    lines += [""] + _schedule_lines(plan)
    rank = {True: 0, None: 1, False: 2}  # feasible, not priced, infeasible
    alts = sorted(plan.alternatives, key=lambda a: (rank.get(a.feasible, 2),
                                                   a.step_time_s or float("inf")))
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
    fits = "yes" if device is None or (p.memory_margin_bytes >= 0 if p.memory_reserve_bytes_by_stage
                                       else p.peak_memory_bytes <= device) else "**no**"
    return [name, f"`{plan_flags(hand)}`", format_seconds(p.step_time_s),
            format_tflops(p.tflops_per_gpu), f"{p.mfu:.1%}", format_gib(p.peak_memory_bytes),
            f"{auto.predicted.step_time_s / p.step_time_s:.2f}" if p.step_time_s else "–", fits]


def hand_section(plan: Plan, hand_layouts: dict[str, Plan | str]) -> list[str]:
    """Hand-written layouts priced by the same cost model, beside the auto plan."""
    device = device_memory_bytes(plan)
    rows = [_hand_row("**autopar (this plan)**", plan, plan, device)]
    rows += [_hand_row(name, hand, plan, device) for name, hand in hand_layouts.items()]
    lines = ["## Hand-written layouts priced by the same cost model", "",
             "*auto/hand* is the auto plan's step time over the hand layout's: below 1 the "
             "auto plan is faster.", ""]
    lines += _table(["layout", "flags", "step time", "TFLOP/s/GPU", "MFU", "peak memory (GiB)",
                     "auto/hand", "fits with the reserve"], rows, "llrrrrrl")
    for name, hand in hand_layouts.items():
        if isinstance(hand, Plan) and hand.predicted.step_time_s:
            speedup = hand.predicted.step_time_s / plan.predicted.step_time_s
            word = "faster" if speedup >= 1 else "slower"
            lines.append(f"- against {name}: the auto plan is {max(speedup, 1 / speedup):.2f}× "
                         f"{word} ({format_seconds(plan.predicted.step_time_s)} vs "
                         f"{format_seconds(hand.predicted.step_time_s)} per step).")
    return lines + [""]


def formulas_section() -> list[str]:
    """The published closed forms the cost model is checked against: the static table of
    :mod:`autopar.report.formulas` (equal to ``autopar.oracle.symbolic.formulas_markdown()``)."""
    return ["", "## How the cost model is checked", "",
            "Every number above comes from one cost model (`autopar/planner/costs/tables.py` over "
            "`cost_models/`); these are the published formulas it reproduces, and "
            "`reports/published_vs_predicted.md` compares it with published Megatron-LM runs.",
            ""] + FORMULAS_MARKDOWN.splitlines()


def image(alt: str, path: str | None) -> list[str]:
    """A Markdown image paragraph, or nothing when the chart was not drawn."""
    return [f"![{alt}]({path})", ""] if path else []
