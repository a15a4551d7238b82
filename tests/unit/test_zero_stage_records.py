"""The ZeRO-stage records (autopar.techniques.zero_stages): every stage has a rule, a price,
a runner, a drawing and an answer for every framework target, and the flow reads them
(the runtime support, the targets, plan validation list exactly their stages)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from helpers import framework_answer_gaps, runtime_class
from autopar.contract.plan import ZERO_STAGES, Plan
from autopar.contract.support import EXECUTED_ZERO_STAGES, FULLY_SHARDED_STAGE, RUNTIME_SUPPORT
from autopar.frameworks.targets import TARGETS
from autopar.planner.costs.comm_bytes import dp_comm_bytes
from autopar.planner.costs.tables import Config
from autopar.planner.costs.precision import bytes_per_param
from autopar.report.sections import layout_section
from autopar.techniques.pipeline_schedules import FRAMEWORK_TARGETS
from autopar.techniques.zero_stages import (ZERO_STAGE_RECORDS, ZeroStage, framework_zero_stages,
                                            zero_stage, zero_stage_for)

EXAMPLE_PLAN = "reports/gpt-1.3b-dgx-a100-1/plan.json"


def missing(record: ZeroStage, plan: Plan) -> list[str]:
    """What ``record`` lacks among rule, price, runner, drawing and framework answers
    (``plan``: a plan to draw the record's stage in)."""
    out = []
    try:
        alone, piped = record.problem(1), record.problem(2)
    except Exception as exc:  # a rule that cannot be asked is missing
        out.append(f"rule: {exc}")
    else:
        if alone is not None or (piped is None) == record.reduces_each_micro_batch:
            out.append(f"rule: pp=1 {alone!r}, pp=2 {piped!r}")
    d, m = 8, 4
    cfg = Config(tp=1, pp=1, dp=d, micro_batch_size=1, num_micro_batches=m, dtype="bf16")
    try:
        states = bytes_per_param(record.stage, d)
        comm = dp_comm_bytes(1e6, record.stage, cfg, 2, 2, ([1000] * 2, 1000))
    except Exception as exc:  # a price that cannot be evaluated is missing
        out.append(f"price: {exc}")
    else:
        sharded = (record.shards_optimizer, record.shards_gradients, record.shards_parameters)
        want = 2 + 2 + 12 - sum(b * (1 - 1 / d) for b, on in zip((12, 2, 2), sharded) if on)
        if not (math.isfinite(states) and math.isclose(states, want)):
            out.append(f"price: {states} model-state bytes per parameter, the shards say {want}")
        if f"dp_{record.gradient_collective}" not in comm:
            out.append(f"price: the gradients take {sorted(comm)}, the record says "
                       f"{record.gradient_collective}")
    runner = runtime_class(record.runner)
    if not (runner is not None and hasattr(runner, "step")):
        out.append(f"runner: {record.runner} is not an autopar optimizer class")
    row = next((line for line in layout_section(dataclasses.replace(plan, zero_stage=record.stage))
                if line.startswith("| ZeRO stage")), "")
    if not (record.title.startswith(f"ZeRO-{record.stage}") and record.title in row):
        out.append(f"drawing: the report's row {row!r} does not show {record.title!r}")
    return out + framework_answer_gaps(record)


@pytest.fixture(scope="module")
def plan() -> Plan:
    with open(EXAMPLE_PLAN) as f:
        return Plan.from_json(f.read(), EXAMPLE_PLAN)


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_every_stage_has_a_rule_price_runner_drawing_and_framework_answers(stage, plan):
    assert missing(zero_stage(stage), plan) == []


@pytest.mark.parametrize("broken, lacks", [
    (dict(reduces_each_micro_batch=True), "rule"),  # leaves each micro-batch, yet pipelines
    (dict(with_pipeline="never"), "rule"),
    (dict(shards_gradients=True), "price"),
    (dict(shards_optimizer=False), "price"),
    (dict(runner="autopar.runtime.zero.NoSuchOptimizer"), "runner"),
    (dict(title="replicated"), "drawing"),
    (dict(frameworks={"megatron": "DistributedDataParallel"}), "framework"),
])
def test_the_registry_check_fails_when_a_record_lacks_one(broken, lacks, plan):
    record = dataclasses.replace(zero_stage(1), **broken)
    assert any(line.startswith(lacks) for line in missing(record, plan)), missing(record, plan)


def test_the_flow_lists_exactly_the_records():
    assert tuple(ZERO_STAGE_RECORDS) == ZERO_STAGES == RUNTIME_SUPPORT.zero_stages
    assert (*EXECUTED_ZERO_STAGES, FULLY_SHARDED_STAGE) == ZERO_STAGES
    for target in FRAMEWORK_TARGETS:  # a target runs a stage exactly when it names it
        assert TARGETS[target].zero_stages == framework_zero_stages(target)
        for stage in framework_zero_stages(target):
            assert zero_stage_for(target, zero_stage(stage).frameworks[target]).stage == stage
    # what each framework's configuration code takes (tests/unit/test_framework_startup.py)
    assert framework_zero_stages("megatron") == (0, 1)
    assert framework_zero_stages("torchtitan") == (0, 3)
    assert framework_zero_stages("deepspeed") == (0, 1, 2, 3)


def test_unknown_stages_and_settings_are_clear_errors():
    for bad in (4, -1, True, "1"):
        with pytest.raises(ValueError, match="zero_stage must be one of"):
            zero_stage(bad)
    with pytest.raises(ValueError, match="megatron ZeRO setting '--use-torch-fsdp2': autopar prices"):
        zero_stage_for("megatron", "--use-torch-fsdp2")
    with pytest.raises(ValueError, match="unknown framework"):
        framework_zero_stages("nemo")
    assert "pp=1" in zero_stage(3).problem(4) and zero_stage(1).problem(4) is None
