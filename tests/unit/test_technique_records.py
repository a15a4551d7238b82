"""The technique records (autopar.techniques): every value of every technique has a rule, a
price, a runner, a drawing and an answer for every framework target, and the flow reads
the records (the runtime, the targets, the CLI list exactly their values)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from autopar.frameworks.targets import TARGETS
from autopar.contract.plan import SCHEDULES as PLAN_SCHEDULES
from autopar.report.schedule import makespan_s, simulate_schedule
from autopar.contract.support import RUNTIME_SUPPORT, pipeline_problem
from autopar.techniques.pipeline_schedules import (FRAMEWORK_TARGETS, PIPELINE_SCHEDULES,
                                                   SCHEDULES, PipelineSchedule, Refusal,
                                                   pipeline_schedule, schedule_for)


def _example(record: PipelineSchedule) -> tuple[int, int, int, int]:
    """(p, m, v, L) every schedule runs: 2 stages, 4 micro-batches, 8 layers."""
    return 2, 4, 2 if record.interleaved else 1, 8


def missing(record: PipelineSchedule) -> list[str]:
    """What ``record`` lacks among rule, price, runner, drawing and framework answers."""
    out = []
    p, m, v, L = _example(record)
    if not callable(record.rule) or record.problem(p, m, v, L) is not None:
        out.append("rule: does not accept the example layout")
    elif record.problem(p, m, 2 if v == 1 else 1, L) is None:
        out.append("rule: accepts the wrong number of chunks per rank")
    try:
        held = [record.in_flight(p, i, m, v) for i in range(p)]
        step = record.step_time_s([1.0] * p, m, v, 0.1, weight_grad_s=[0.25] * p)
    except Exception as exc:  # a price that cannot be evaluated is missing
        out.append(f"price: {exc}")
    else:
        if not all(math.isfinite(x) and 0 < x <= m for x in held):
            out.append(f"price: in-flight micro-batches {held} outside (0, m]")
        if not (math.isfinite(step) and step >= m * 1.0):
            out.append(f"price: step time {step} below the work of m micro-batches")
        unsplit = pipeline_schedule("1f1b").step_time_s([1.0] * p, m, v, 0.1)
        if record.split_backward and not step < unsplit:
            out.append("price: the weight gradients do not fill the bubble")
    runner = getattr(pipelining, record.runner, None)
    base = PipelineScheduleMulti if record.interleaved else (PipelineScheduleSingle,
                                                             PipelineScheduleMulti)
    if not (isinstance(runner, type) and issubclass(runner, base)):
        out.append(f"runner: torch.distributed.pipelining.{record.runner} is not a "
                   f"pipeline schedule{' taking several stages' if record.interleaved else ''}")
    kinds = "FBW" if record.split_backward else "FB"
    try:
        orders = [record.order(p, m, i, v) for i in range(p)]
        timeline = simulate_schedule(record.name, p, m, [1.0] * p, [2.0] * p, virtual_stages=v,
                                     weight_grad_s=[0.5] * p)
    except Exception as exc:  # a drawing that cannot be drawn is missing
        out.append(f"drawing: {exc}")
    else:
        every = sorted((k, j, c) for k in kinds for j in range(m) for c in range(v))
        if any(sorted(order) != every for order in orders) or not makespan_s(timeline) > 0:
            out.append("drawing: a rank does not run each block exactly once")
    for target in FRAMEWORK_TARGETS:
        answer = record.frameworks.get(target)
        if not (isinstance(answer, str) and answer or isinstance(answer, Refusal) and
                answer.reason):
            out.append(f"framework: no answer for {target}")
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_has_a_rule_price_runner_drawing_and_framework_answers(name):
    assert missing(pipeline_schedule(name)) == []


@pytest.mark.parametrize("broken, lacks", [
    (dict(rule=lambda p, m, v, L: "never"), "rule"),
    (dict(in_flight=lambda p, i, m, v: float("nan")), "price"),
    (dict(runner="ScheduleThatDoesNotExist"), "runner"),
    (dict(order=lambda p, m, i, v: [("F", 0, 0)]), "drawing"),
    (dict(frameworks={"megatron": "1F1B", "torchtitan": "1F1B"}), "framework"),
    (dict(frameworks={"megatron": "1F1B", "torchtitan": "1F1B", "deepspeed": Refusal("")}),
     "framework"),
    (dict(split_backward=True), "drawing"),  # a split backward drawn without its W blocks
])
def test_the_registry_check_fails_when_a_record_lacks_one(broken, lacks):
    record = dataclasses.replace(pipeline_schedule("1f1b"), **broken)
    assert any(line.startswith(lacks) for line in missing(record)), missing(record)


def test_the_flow_lists_exactly_the_records():
    assert PLAN_SCHEDULES == SCHEDULES == tuple(PIPELINE_SCHEDULES) == RUNTIME_SUPPORT.schedules
    assert set(FRAMEWORK_TARGETS) == set(TARGETS) - {"autopar"}
    for target in FRAMEWORK_TARGETS:  # a target runs a schedule exactly when it names it
        named = {n for n, s in PIPELINE_SCHEDULES.items() if isinstance(s.frameworks[target], str)}
        assert set(TARGETS[target].schedules) == named
        for name in named:
            assert schedule_for(target, PIPELINE_SCHEDULES[name].frameworks[target]).name == name


def test_refusals_and_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="pipeline schedule 'zigzag' is not one of"):
        pipeline_schedule("zigzag")
    assert "is not one of" in pipeline_problem("zigzag", 2, 4, 8)
    with pytest.raises(ValueError, match="deepspeed cannot run pipeline schedule 'gpipe': "
                                         "DeepSpeed's PipelineEngine runs"):
        pipeline_schedule("gpipe").framework_name("deepspeed")
    with pytest.raises(ValueError, match=r"torchtitan pipeline schedule 'ZBVZeroBubble': "
                                         r"autopar prices \['GPipe', '1F1B'"):
        schedule_for("torchtitan", "ZBVZeroBubble")


@pytest.mark.parametrize("name, p, m, v, L, says", [
    ("1f1b", 4, 3, 1, 8, "m=3 < p=4"),
    ("1f1b", 2, 4, 2, 8, "virtual_stages=2 needs schedule 'interleaved_1f1b'"),
    ("gpipe", 4, 3, 2, 8, "virtual_stages=2 needs schedule 'interleaved_1f1b'"),
    ("interleaved_1f1b", 1, 4, 2, 8, "needs pp > 1"),
    ("interleaved_1f1b", 2, 3, 2, 8, "m=3, pp=2"),
    ("interleaved_1f1b", 2, 4, 3, 8, "not divisible by 6"),
    ("zb_h1", 1, 4, 1, 8, "ZB-H1 needs pp > 1"),
    ("zb_h1", 4, 3, 1, 8, "ZB-H1 needs at least as many micro-batches"),
    ("zb_h1", 4, 9, 1, 8, "rounds of equal size: m=9, p=4"),
])
def test_each_rule_names_what_to_change(name, p, m, v, L, says):
    assert says in pipeline_schedule(name).problem(p, m, v, L)
    assert pipeline_schedule("gpipe").problem(4, 3, 1, 8) is None  # GPipe runs any m


def _torch_order(runner: str, p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The blocks torch's ``runner`` runs on ``rank`` of p one-stage ranks, built on the fake
    process group (no communication: the schedule is computed at construction)."""
    import torch
    from framework_startup import fake_process_group

    with fake_process_group(p, rank):
        x = torch.empty(1, 2, device="meta")
        stage = pipelining.PipelineStage(torch.nn.Linear(2, 2), rank, p, torch.device("cpu"),
                                         input_args=x, output_args=x)
        schedule = getattr(pipelining, runner)([stage], m)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [(kinds[a.computation_type.name], a.microbatch_index, 0)
            for a in schedule.pipeline_order[rank] if a is not None]


@pytest.mark.parametrize("name", [n for n, s in PIPELINE_SCHEDULES.items() if s.split_backward])
def test_a_split_backward_drawing_is_the_order_torch_runs(name):
    """The report draws what the runner runs: for every p <= 4 and p <= m <= 3p the rule
    accepts, each rank's F, B and W blocks in torch's own order."""
    record = pipeline_schedule(name)
    for p in (2, 3, 4):
        for m in range(p, 3 * p + 1):
            if record.problem(p, m) is None:
                for rank in range(p):
                    assert record.order(p, m, rank, 1) == _torch_order(record.runner, p, m, rank)


@pytest.mark.parametrize("name", [n for n, s in PIPELINE_SCHEDULES.items() if s.split_backward])
@pytest.mark.parametrize("p, m, w", [(4, 8, 1.0), (4, 8, 0.5), (2, 4, 1.0), (8, 24, 0.9)])
def test_a_split_backward_drawing_takes_as_long_as_its_price(name, p, m, w):
    """Equal stages (F = 1, backward 2 of which W = w, c = 0): the timeline simulated from
    torch's order ends exactly at the priced pipeline time, e.g. 27 = 8·3 + 3·(3 − 2) at
    p = 4, m = 8, w = 1 (1F1B: 33)."""
    timeline = simulate_schedule(name, p, m, [1.0] * p, [2.0] * p, weight_grad_s=[w] * p)
    priced = pipeline_schedule(name).step_time_s([3.0] * p, m, 1, 0.0, weight_grad_s=[w] * p)
    assert makespan_s(timeline) == pytest.approx(priced)
    assert priced < pipeline_schedule("1f1b").step_time_s([3.0] * p, m)
    with pytest.raises(ValueError, match="one weight-gradient time when given"):
        simulate_schedule(name, p, m, [1.0] * p, [2.0] * p, weight_grad_s=[w])


def test_a_split_backward_refuses_full_recompute_at_every_door():
    """ZB-H1 with full recompute: torch's split backward recomputes a checkpointed layer per
    weight group (more recompute and TP traffic than priced), so the search never emits it,
    a pinned layout says why, and a plan carrying it is refused by the executability check."""
    import autopar
    from autopar.contract.support import check_executable, unsupported
    from helpers import TINY_BATCH, TINY_SEQ, tiny_meta_gpt

    meta, cluster = tiny_meta_gpt(), autopar.Cluster.local_cpu(processes=2)
    kw = dict(global_batch_size=TINY_BATCH, seq_len=TINY_SEQ)
    with pytest.raises(ValueError, match="recompute='full' with schedule 'zb_h1': torch's "
                                         "split backward"):
        autopar.plan(meta, cluster, layout=autopar.Layout(pp=2, schedule="zb_h1",
                                                           recompute="full"), **kw)
    plan = autopar.plan(meta, cluster, layout=autopar.Layout(pp=2, schedule="zb_h1"), **kw)
    assert "full" not in plan.recompute
    full = dataclasses.replace(plan, recompute=["full"] * len(plan.recompute))
    problem = unsupported(full)
    assert (problem.field, problem.value) == ("recompute", "full")
    assert "full" not in problem.allowed and "weight-gradient pass" in problem.why
    with pytest.raises(NotImplementedError, match="recompute='full' with schedule 'zb_h1'"):
        check_executable(full)


def test_the_search_picks_zb_h1_where_it_pays_and_the_report_says_why():
    """Four pipeline stages of a GPT on one DGX H100 node: ZB-H1 runs the weight gradients
    in 1F1B's fill and drain at 1F1B's memory, so the search takes it (over interleaved
    1F1B too); a Megatron-LM target, which has no zero-bubble schedule, does not."""
    import torch

    import autopar
    from autopar.models import GPT, GPTConfig
    from autopar.report.sections import why_section

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=8, n_head=16, n_embd=1024, vocab_size=50304,
                              block_size=1024))
    cluster = autopar.Cluster.dgx_h100(nodes=1)
    kw = dict(global_batch_size=32, seq_len=1024, layout=autopar.Layout(tp=2, pp=4))
    plan = autopar.plan(model, cluster, **kw)
    assert plan.schedule == "zb_h1"
    megatron = autopar.plan(model, cluster, target="megatron", **kw)
    assert not pipeline_schedule(megatron.schedule).split_backward
    assert plan.predicted.step_time_s < megatron.predicted.step_time_s
    text = "\n".join(why_section(plan))
    assert "ZB-H1 (Qi et al. 2024" in text and "the W's fill" in text, text
