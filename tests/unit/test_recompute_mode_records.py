"""The recompute-mode records (autopar.techniques.recompute_modes): every mode has a rule, a
price, a runner, a drawing and an answer for every framework target, and the flow reads
them (the plan contract, the runtime support and the targets list exactly their modes)."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import framework_answer_gaps
from autopar.contract.plan import RECOMPUTE_MODES
from autopar.contract.support import RUNTIME_SUPPORT
from autopar.frameworks.targets import TARGETS
from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.report.sections import _recompute_summary as recompute_summary
from autopar.rewrite.recompute import RUNNERS, Checkpointed
from autopar.techniques.pipeline_schedules import FRAMEWORK_TARGETS, PIPELINE_SCHEDULES
from autopar.techniques.recompute_modes import (RECOMPUTE_MODE_RECORDS, RecomputeMode,
                                                framework_recompute_modes, mode_recomputing,
                                                recompute_mode, recompute_mode_for,
                                                recomputed_by)
from cost_models.memory import transformer_layer_activation_bytes

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=0.0)
# what a mode's runner leaves in the graph: a checkpointed attention core per layer, or the
# whole layer checkpointed; names of autopar.rewrite.recompute
CHECKPOINTED = {"nothing": (), "attention_core": ("recompute_attention_",),
                "layer": ("recompute_layer_",)}


def missing(record: RecomputeMode) -> list[str]:
    """What ``record`` lacks among rule, price, runner, drawing and framework answers."""
    out = []
    refusals = [s.name for s in PIPELINE_SCHEDULES.values() if record.name in s.refused_recompute]
    if record.name not in RECOMPUTE_MODES or len(refusals) == len(PIPELINE_SCHEDULES):
        out.append(f"rule: {record.name!r} is not a Layout.recompute value any schedule runs")
    # the price against Korthikanti et al. 2022, Table 2 (tp 2, no sequence parallelism)
    s, b, h, a, t = 64, 2, 32, 4, 2
    layer = transformer_layer_activation_bytes(s, b, h, a, tp=t)
    core = 5 * a * s / (h * t) * s * b * h
    want = transformer_layer_activation_bytes(s, b, h, a, tp=t, recompute=record.name) \
        if record.name in RECOMPUTE_MODES else None
    kept = record.kept(layer, core, 2 * s * b * h)
    redone = record.recomputed(10.0, 3.0)
    if kept != pytest.approx(want) or redone != {"nothing": 0.0, "attention_core": 3.0,
                                                 "layer": 10.0}[record.recomputes]:
        out.append(f"price: keeps {kept} (Table 2: {want}), recomputes {redone}")
    traced = trace_model(GPT(CONFIG), CONFIG.block_size)
    try:  # the record's pass on every layer, as apply_recompute runs it
        for layer, names in enumerate(traced.layers):
            RUNNERS[record.runner](traced.gm, names, layer, None)
    except Exception as exc:  # a runner that cannot run is missing
        out.append(f"runner: {record.runner}: {exc}")
    else:
        wrapped = sorted(n for n, m in traced.gm.named_children() if isinstance(m, Checkpointed))
        expect = CHECKPOINTED[record.recomputes]
        if len(wrapped) != len(expect) * CONFIG.n_layer or not all(
                n.startswith(expect) for n in wrapped):
            out.append(f"runner: {record.runner} checkpointed {wrapped}")
    row = recompute_summary([record.name] * 4) if record.name in RECOMPUTE_MODES else ""
    if not (record.title.startswith(record.name + " (") and record.title in row):
        out.append(f"drawing: the report's {row!r} does not show {record.title!r}")
    return out + framework_answer_gaps(record)


@pytest.mark.parametrize("name", RECOMPUTE_MODES)
def test_every_mode_has_a_rule_price_runner_drawing_and_framework_answers(name):
    assert missing(recompute_mode(name)) == []


@pytest.mark.parametrize("broken, lacks", [
    (dict(name="most"), "rule"),
    (dict(recomputes="layer"), "price"),
    (dict(runner="checkpoint_layer"), "runner"),
    (dict(runner="no_such_pass"), "runner"),
    (dict(title="the attention core"), "drawing"),
    (dict(frameworks={"megatron": "selective"}), "framework"),
])
def test_the_registry_check_fails_when_a_record_lacks_one(broken, lacks):
    record = dataclasses.replace(recompute_mode("selective"), **broken)
    assert any(line.startswith(lacks) for line in missing(record)), missing(record)


def test_the_flow_lists_exactly_the_records():
    assert tuple(RECOMPUTE_MODE_RECORDS) == RECOMPUTE_MODES == RUNTIME_SUPPORT.recompute
    assert set(RUNNERS) == {r.runner for r in RECOMPUTE_MODE_RECORDS.values()}
    for target in FRAMEWORK_TARGETS:  # a target runs a mode exactly when it names it
        assert TARGETS[target].recompute == framework_recompute_modes(target)
        for name in framework_recompute_modes(target):
            setting = recompute_mode(name).frameworks[target]
            assert recompute_mode_for(target, setting).name == name
    for schedule in PIPELINE_SCHEDULES.values():  # the schedules refuse modes by their names
        assert set(schedule.refused_recompute) <= set(RECOMPUTE_MODE_RECORDS)
    assert [mode_recomputing(w).name for w in ("nothing", "attention_core", "layer")] == [
        "none", "selective", "full"]


def test_the_planner_counts_what_the_allowed_modes_recompute():
    assert recomputed_by(("none", "full")) == {"nothing": True, "attention_core": False,
                                               "layer": True}
    assert recomputed_by(("selective",)) == {"nothing": False, "attention_core": True,
                                             "layer": False}


def test_unknown_modes_and_refused_settings_are_clear_errors():
    for bad in ("all", None, 1):
        with pytest.raises(ValueError, match="recompute must be one of"):
            recompute_mode(bad)
    with pytest.raises(ValueError, match="torchtitan recompute setting 'selective': "
                                         "torchtitan's"):
        recompute_mode_for("torchtitan", "selective")
    with pytest.raises(ValueError, match=r"torchtitan activation_checkpoint.mode 'op': autopar "
                                         r"prices \['none', 'full'\]"):
        recompute_mode_for("torchtitan", "op", "activation_checkpoint.mode")
    with pytest.raises(ValueError, match="deepspeed recompute setting '2': autopar prices"):
        recompute_mode_for("deepspeed", "2")
    with pytest.raises(ValueError, match="unknown framework"):
        framework_recompute_modes("nemo")
    with pytest.raises(ValueError, match="is not one of"):
        dataclasses.replace(recompute_mode("full"), recomputes="mlp")
