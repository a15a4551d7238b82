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
from autopar.plan import SCHEDULES as PLAN_SCHEDULES
from autopar.report.schedule import makespan_s, simulate_schedule
from autopar.support import RUNTIME_SUPPORT, pipeline_problem
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
])
def test_each_rule_names_what_to_change(name, p, m, v, L, says):
    assert says in pipeline_schedule(name).problem(p, m, v, L)
    assert pipeline_schedule("gpipe").problem(4, 3, 1, 8) is None  # GPipe runs any m

