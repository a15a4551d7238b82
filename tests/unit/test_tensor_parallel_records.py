"""The tensor-parallel records (autopar.techniques.tensor_parallel): with and without
sequence parallelism, each has a rule, a price, a runner, a drawing and an answer for
every framework target, and the flow reads them (the strategies' transitions and LayerNorm
shards, the pins, the targets, the report, the Megatron emitter)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from helpers import framework_answer_gaps, runtime_class
from autopar.contract.placement import PARTIAL, REPLICATE, Shard
from autopar.contract.plan import Plan
from autopar.contract.support import RUNTIME_SUPPORT, check_pins
from autopar.frameworks.targets import TARGETS
from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.planner.strategies import SEQUENCE_DIM, node_strategies, reshard_kinds
from autopar.report.sections import layout_section
from autopar.runtime.tp_modules import TPOperator
from autopar.techniques.answers import FRAMEWORK_TARGETS
from autopar.techniques.tensor_parallel import (TENSOR_PARALLEL_RECORDS, TensorParallelMode,
                                                framework_max_tp, framework_sequence_parallel,
                                                sequence_parallel_for, tensor_parallel_mode)
from cost_models.memory import transformer_layer_activation_bytes

import autopar

EXAMPLE_PLAN = "reports/gpt-1.3b-dgx-a100-1/plan.json"
S, B, H, A, T = 2048, 1, 2048, 16, 4


def _table_2(shards_sequence: bool) -> float:
    """Korthikanti et al. 2022, Table 2: a layer's kept bytes under TP of T ranks, with or
    without sequence parallelism (no recompute)."""
    linear = 34 / T if shards_sequence else 10 + 24 / T
    return S * B * H * (linear + 5 * A * S / (H * T))


def missing(record: TensorParallelMode, plan: Plan, traced) -> list[str]:
    """What ``record`` lacks among rule, price, runner, drawing and framework answers."""
    out = []
    try:
        alone, split = record.problem(1), record.problem(2)
    except Exception as exc:  # a rule that cannot be asked is missing
        out.append(f"rule: {exc}")
    else:
        if split is not None or (alone is None) == record.shards_sequence:
            out.append(f"rule: tp=1 {alone!r}, tp=2 {split!r}")
    sp = record.sequence_parallel
    kept = transformer_layer_activation_bytes(S, B, H, A, tp=T, sequence_parallel=sp)
    if not math.isclose(kept, _table_2(record.shards_sequence)):
        out.append(f"price: {kept:.0f} kept bytes per layer, Table 2 says "
                   f"{_table_2(record.shards_sequence):.0f}")
    completed = Shard(SEQUENCE_DIM) if record.shards_sequence else REPLICATE
    if reshard_kinds(PARTIAL, completed, sp) != record.region_collectives:
        out.append(f"price: a partial output is completed by "
                   f"{reshard_kinds(PARTIAL, completed, sp)}, the record says "
                   f"{record.region_collectives}")
    norms = [options for name, options in node_strategies(traced, 2, sp).items()
             if traced.nodes[name].kind == "layernorm"]
    on_shards = all(any(s.output == Shard(SEQUENCE_DIM) for s in options) for options in norms)
    if not norms or on_shards != record.shards_sequence:
        out.append(f"price: LayerNorm on sequence shards offered: {on_shards}")
    runner = runtime_class(record.runner)
    if not (runner is not None and issubclass(runner, TPOperator)
            and (runner.forward_comm, runner.backward_comm) == tuple(
                c and f"tp_{c}" for c in record.region_collectives)):
        out.append(f"runner: {record.runner} is not the TP operator of "
                   f"{record.region_collectives}")
    row = next((line for line in layout_section(dataclasses.replace(plan, sequence_parallel=sp))
                if line.startswith("| tensor parallel t")), "")
    if row != f"| tensor parallel t | {plan.tp}{record.title} |" or (
            "sequence parallel" in record.title) != record.shards_sequence:
        out.append(f"drawing: the report's row {row!r} does not show {record.title!r}")
    return out + framework_answer_gaps(record)


@pytest.fixture(scope="module")
def plan() -> Plan:
    with open(EXAMPLE_PLAN) as f:
        return Plan.from_json(f.read(), EXAMPLE_PLAN)


@pytest.fixture(scope="module")
def traced():
    return trace_model(GPT(GPTConfig(2, 4, 64, 256, 64)).to("meta"), 64)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_mode_has_a_rule_price_runner_drawing_and_framework_answers(
        sequence_parallel, plan, traced):
    assert missing(tensor_parallel_mode(sequence_parallel), plan, traced) == []


@pytest.mark.parametrize("sequence_parallel, broken, lacks", [
    (True, dict(min_tp=1), "rule"),  # sequence shards of one rank
    (False, dict(min_tp=2), "rule"),
    (True, dict(shards_sequence=False), "price"),
    (False, dict(region_collectives=("reduce_scatter", "all_gather")), "price"),
    (True, dict(runner="autopar.runtime.tp_modules.ReduceFromTPRegion"), "runner"),
    (False, dict(runner="autopar.runtime.tp_modules.NoSuchOperator"), "runner"),
    (True, dict(title=""), "drawing"),
    (False, dict(frameworks={"megatron": "--tensor-model-parallel-size"}), "framework"),
])
def test_the_registry_check_fails_when_a_record_lacks_one(sequence_parallel, broken, lacks,
                                                          plan, traced):
    record = dataclasses.replace(tensor_parallel_mode(sequence_parallel), **broken)
    out = missing(record, plan, traced)
    assert any(line.startswith(lacks) for line in out), out


def test_the_flow_lists_exactly_the_records(plan):
    assert tuple(TENSOR_PARALLEL_RECORDS) == RUNTIME_SUPPORT.sequence_parallel == (False, True)
    for target in FRAMEWORK_TARGETS:  # a target runs a mode exactly when it names it
        assert TARGETS[target].sequence_parallel == framework_sequence_parallel(target)
        assert TARGETS[target].max_tp == framework_max_tp(target)
    # what each framework's configuration code takes (tests/unit/test_framework_startup.py)
    assert framework_sequence_parallel("megatron") == (False, True)
    assert framework_sequence_parallel("torchtitan") == (True,)
    assert (framework_sequence_parallel("deepspeed"), framework_max_tp("deepspeed")) == ((False,), 1)
    assert sequence_parallel_for("megatron", "--sequence-parallel").sequence_parallel is True
    from autopar.frameworks.megatron import megatron_args

    runnable = dataclasses.replace(plan, tp=2, dp=plan.dp // 2, zero_stage=1,
                                   recompute=type(plan.recompute)(["none"] * len(plan.recompute)))
    for sp in (False, True):
        args = megatron_args(dataclasses.replace(runnable, sequence_parallel=sp))
        assert ("--sequence-parallel" in args) is sp


def test_pins_and_lookups_refuse_by_the_record():
    with pytest.raises(ValueError, match="tp=1 is pinned; pin tp >= 2"):
        check_pins(autopar.Layout(tp=1, sequence_parallel=True))
    check_pins(autopar.Layout(tp=2, sequence_parallel=True))
    for bad in (None, 1, "true"):
        with pytest.raises(ValueError, match="sequence_parallel must be one of"):
            tensor_parallel_mode(bad)
    with pytest.raises(ValueError, match="megatron tensor-parallel setting '--tp': autopar prices"):
        sequence_parallel_for("megatron", "--tp")
