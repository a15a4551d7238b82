"""The report's pipeline schedule (:mod:`autopar.report.schedule`) draws what is priced.

GPipe, 1F1B and interleaved 1F1B laid out from the cost model's forward, backward and
recompute seconds (``Prediction.stage_phase_s``): every block once, dependencies and rank
order kept; the makespan equals ``cost_models.pipeline``'s pipeline time plus one
point-to-point transfer c (the drawing charges every chunk its sends, the closed form
p - 1 boundaries of fill and drain), exactly for equal stages and for plans whose stages
differ only by the embedding and the head; interleaved plans show v chunks per rank and a
recompute plan's backward blocks are longer by the recompute time.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.models import GPT, preset
from autopar.report.plots import write_timeline_chart
from autopar.report.schedule import (Block, drawn_micro_batches, makespan_s, plan_phases,
                                     plan_timeline, schedule_order, simulate_schedule)
from autopar.techniques.pipeline_schedules import pipeline_schedule

PNG = b"\x89PNG"


def _check_timeline(timeline: list[list[Block]], pp: int, m: int, v: int = 1) -> None:
    """Every (kind, micro-batch, chunk) once per rank, no overlap on a rank, and each block
    after its input: the previous virtual stage's forward, the next one's backward."""
    ready = {(b.kind, b.chunk * pp + i, b.micro_batch): b.end_s + b.send_s
             for i, blocks in enumerate(timeline) for b in blocks}
    assert len(ready) == 2 * pp * v * m
    for i, blocks in enumerate(timeline):
        for prev, blk in zip(blocks, blocks[1:]):
            assert blk.start_s >= prev.end_s + prev.send_s - 1e-12
        for blk in blocks:
            stage = blk.chunk * pp + i
            if blk.kind == "F" and stage > 0:
                assert blk.start_s >= ready[("F", stage - 1, blk.micro_batch)] - 1e-12
            if blk.kind == "B":
                dep = ("B", stage + 1) if stage < pp * v - 1 else ("F", stage)
                assert blk.start_s >= ready[dep + (blk.micro_batch,)] - 1e-12


@pytest.mark.parametrize("schedule, pp, m, v", [
    ("gpipe", 1, 3, 1), ("gpipe", 4, 8, 1), ("gpipe", 3, 7, 1), ("1f1b", 2, 2, 1),
    ("1f1b", 4, 8, 1), ("1f1b", 3, 7, 1), ("interleaved_1f1b", 2, 4, 2),
    ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 4, 3), ("interleaved_1f1b", 2, 6, 4)])
@pytest.mark.parametrize("c", [0.0, 0.1])
def test_equal_stages_makespan_is_the_cost_models_plus_one_transfer(schedule, pp, m, v, c):
    f, b, r = 1.0, 2.0, 0.5
    timeline = simulate_schedule(schedule, pp, m, [f] * pp, [b] * pp, recompute_s=[r] * pp,
                                 p2p_s=c, virtual_stages=v)
    _check_timeline(timeline, pp, m, v)
    priced = pipeline_schedule(schedule).step_time_s([f + b + r] * pp, m, v, c)
    assert makespan_s(timeline) == pytest.approx(priced + (c if pp > 1 else 0.0), rel=1e-12)
    if c == 0.0:  # the textbook forms: (m + p - 1)·t, interleaved m·t + (p - 1)·t / v
        assert makespan_s(timeline) == pytest.approx((m + (pp - 1) / v) * (f + b + r))


def test_schedule_orders():
    # 1F1B: stage 0 of p=3 warms up with p - 1 = 2 forwards, then alternates F, B
    assert schedule_order("1f1b", 3, 5, 0)[:5] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0),
                                                   ("B", 0, 0), ("F", 3, 0)]
    assert schedule_order("1f1b", 3, 5, 2)[:3] == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0)]
    # interleaved, p=2, v=2, m=4: rank 0 warms up with (v-1)·p + 2·(p-1) = 4 forwards,
    # p micro-batches of chunk 0, then of chunk 1; backwards start from the last chunk
    order = schedule_order("interleaved_1f1b", 2, 4, 0, 2)
    assert order[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0),
                         ("B", 0, 1)]
    assert sorted(order) == sorted({(k, j, c) for k in "FB" for j in range(4) for c in (0, 1)})
    with pytest.raises(ValueError, match="one forward and one backward time per stage"):
        simulate_schedule("gpipe", 2, 2, [1.0], [2.0])
    with pytest.raises(ValueError, match="pipeline schedule 'zigzag' is not one of"):
        simulate_schedule("zigzag", 1, 1, [1.0], [2.0])
    with pytest.raises(ValueError, match="divisible by pp"):
        schedule_order("interleaved_1f1b", 4, 6, 0, 2)
    # the fewest from the limit up that fill the pipeline and that the schedule's rule takes
    assert drawn_micro_batches("interleaved_1f1b", 6, 192, 16, 2) == 18  # a multiple of p
    assert drawn_micro_batches("1f1b", 16, 192, 16) == 16 == drawn_micro_batches("gpipe", 2, 16, 16)
    assert drawn_micro_batches("zb_h1", 32, 256, 16) == 32  # at least p
    assert drawn_micro_batches("dualpipe_v", 16, 96, 16, 2) == 32  # a V: 2p (and its m >= 2p)
    assert drawn_micro_batches("zb_v", 16, 20, 16, 2) == 20  # never more than m


@pytest.fixture(scope="module")
def gpt13_plans():
    """gpt-1.3b on two DGX A100 nodes, Megatron layouts priced by evaluate: 1F1B, GPipe,
    interleaved (v = 2) without and with full recompute."""
    with torch.device("meta"):
        model = GPT(preset("gpt-1.3b"))
    cluster = autopar.Cluster.dgx_a100(nodes=2)
    layouts = {"1f1b": "tp=2,pp=4,dp=2,mbs=1", "gpipe": "tp=4,pp=4,dp=1,mbs=1,schedule=gpipe",
               "v2": "tp=2,pp=4,dp=2,mbs=1,v=2", "v2-full": "tp=2,pp=4,dp=2,mbs=1,v=2,recompute=full"}
    return {name: autopar.evaluate(model, cluster, autopar.Layout.parse(text),
                                   global_batch_size=32, seq_len=2048)
            for name, text in layouts.items()}


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "v2", "v2-full"])
def test_plan_timeline_makespan_equals_the_predicted_pipeline_time(gpt13_plans, name):
    plan = gpt13_plans[name]
    pred = plan.predicted
    fwd, bwd, rec, c = plan_phases(plan)
    for i, t in enumerate(pred.stage_time_s):  # the phases are the stage time, split
        assert fwd[i] + bwd[i] + rec[i] == pytest.approx(t, rel=1e-12)
    assert c > 0 and pred.time_s_by_kind["pp_p2p"] == pytest.approx(
        plan.num_micro_batches * plan.virtual_stages * c)
    timeline = plan_timeline(plan)
    _check_timeline(timeline, plan.pp, plan.num_micro_batches, plan.virtual_stages)
    pipeline_s = pred.step_time_s - sum(pred.time_s_by_kind[k] for k in ("dp_comm", "optimizer",
                                                                          "step_end"))
    assert pipeline_s == pytest.approx(pipeline_schedule(plan.schedule).step_time_s(
        pred.stage_time_s, plan.num_micro_batches, plan.virtual_stages, c))
    print(f"{name}: drawn {makespan_s(timeline):.6f} s, priced {pipeline_s:.6f} s, c {c:.6f} s")
    assert makespan_s(timeline) == pytest.approx(pipeline_s + c, rel=1e-9)


def test_interleaved_plans_show_v_chunks(gpt13_plans):
    plan = gpt13_plans["v2"]
    fwd, bwd, _, _ = plan_phases(plan)
    for i, blocks in enumerate(plan_timeline(plan)):
        assert {b.chunk for b in blocks} == {0, 1}
        for b in blocks:  # a chunk takes 1/v of the rank's time
            want = (fwd[i] if b.kind == "F" else bwd[i]) / 2
            assert b.end_s - b.start_s == pytest.approx(want)
    assert {b.chunk for b in plan_timeline(gpt13_plans["1f1b"])[0]} == {0}


def test_recompute_makes_backward_blocks_longer_by_the_recompute_time(gpt13_plans):
    plain, full = gpt13_plans["v2"], gpt13_plans["v2-full"]
    rec = plan_phases(full)[2]
    assert all(r > 0 for r in rec) and plan_phases(plain)[2] == [0.0] * plain.pp
    for i, (a, b) in enumerate(zip(plan_timeline(plain), plan_timeline(full))):
        for x, y in zip(a, b):
            assert (x.kind, x.micro_batch, x.chunk) == (y.kind, y.micro_batch, y.chunk)
            grow = (y.end_s - y.start_s) - (x.end_s - x.start_s)
            if x.kind == "B":
                assert y.recompute_s > 0 and y.recompute_s == pytest.approx(rec[i] / 2)
                assert grow == pytest.approx(y.recompute_s, rel=1e-9)
            else:
                assert grow == pytest.approx(0.0, abs=1e-12) and y.recompute_s == 0.0


def test_timeline_chart_of_each_schedule_and_of_an_old_plan(gpt13_plans, tmp_path):
    for name, plan in gpt13_plans.items():
        assert write_timeline_chart(plan, tmp_path / f"{name}.png").read_bytes().startswith(PNG)
    old = dataclasses.replace(gpt13_plans["1f1b"], predicted=dataclasses.replace(
        gpt13_plans["1f1b"].predicted, stage_phase_s=[]))  # a plan saved before the phases
    fwd, bwd, rec, c = plan_phases(old)
    assert bwd == pytest.approx([2 * f for f in fwd]) and rec == [0.0] * 4
    assert c == pytest.approx(plan_phases(gpt13_plans["1f1b"])[3])
    assert write_timeline_chart(old, tmp_path / "old.png").read_bytes().startswith(PNG)


def test_plan_check_reads_the_phases(gpt13_plans):
    from autopar.contract.plan_check import PlanError

    data = gpt13_plans["v2-full"].to_dict()
    assert autopar.Plan.from_dict(data) == gpt13_plans["v2-full"]
    del data["predicted"]["stage_phase_s"][1]["recompute"]
    with pytest.raises(PlanError, match=r"stage_phase_s\[1\]' lacks 'recompute'"):
        autopar.Plan.from_dict(data)
    data["predicted"]["stage_phase_s"][1]["recompute"] = -1.0
    with pytest.raises(PlanError, match=r"stage_phase_s\[1\]\.recompute' must be a finite"):
        autopar.Plan.from_dict(data)
    data["predicted"]["stage_phase_s"] = data["predicted"]["stage_phase_s"][:2]
    with pytest.raises(PlanError, match=r"stage_phase_s' must be a list of 4 objects"):
        autopar.Plan.from_dict(data)
