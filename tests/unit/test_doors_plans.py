"""Property tests (hypothesis) at the plan doors: saved plan JSON mutated field by field,
and plans read against models they were not made for.

The property, for every generated input: each reader (``Plan.from_json``, the
executable check, the model check, ``autopar report``'s renderer, ``evaluate_plan``)
ends in a :class:`~autopar.contract.plan_check.PlanError` (a ValueError: exit code 2) naming the
field, or accepts the plan, and an accepted plan renders and re-prices without error.
Never an internal error (KeyError, TypeError, IndexError ...). Counts per door are printed
at the end of the run (conftest.py).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import autopar
from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.contract.plan_check import PlanError, check_plan
from autopar.planner.plan_fit import check_plan_fits_model
from autopar.report import render_markdown
from helpers import tiny_plan

MANY = settings(max_examples=2500, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from(
        [0.0, -1.0, 2.5, 1e300, float("nan"), float("inf"), "", "x", "none", "full", "1f1b",
         "gpipe", "interleaved_1f1b", "bf16", "column:S2", "replicate:R", "row:P", "nope:Q",
         [], [0, 1], [[0, 1], [1, 2]], [[0, 2]], ["none"], ["none", "full", "none"], {},
         {"a": 1}, 7, 3]))


@pytest.fixture(scope="module")
def base_plans() -> dict[str, dict]:
    """Valid saved plans of gpt-tiny to mutate: TP (Megatron placements), a pipeline, ZeRO-1."""
    return {name: json.loads(plan.to_json()) for name, plan in
            {"tp2": tiny_plan(2, 1), "pp2": tiny_plan(1, 2), "dp2z1": tiny_plan(1, 1, 2, 1)}.items()}


@pytest.fixture(scope="module")
def tiny_and_traces():
    """gpt-tiny on meta and its traces by (seq_len, dtype), so the model check does not
    re-trace for every generated plan."""
    model, _ = autopar.load_model("gpt-tiny")
    return model, {}


def _paths(data: dict, prefix=()) -> list[tuple]:
    """Every path into a plan's JSON (dict keys and list indices), shallow lists only."""
    out = []
    for key, value in data.items():
        out.append(prefix + (key,))
        if isinstance(value, dict) and key not in ("placements", "model_config"):
            out += _paths(value, prefix + (key,))
        elif isinstance(value, list) and value and len(value) < 8:
            out += [prefix + (key, i) for i in range(len(value))]
    return out


def _mutate(data: dict, path: tuple, value) -> dict:
    data = json.loads(json.dumps(data))
    target = data
    for key in path[:-1]:
        target = target[key]
    if value == "DELETE" and isinstance(target, dict):
        del target[path[-1]]
    elif value == "DELETE":
        target.pop(path[-1])
    else:
        target[path[-1]] = value
    return data


@MANY
@given(st.data())
def test_plan_json_door(door_counts, base_plans, tiny_and_traces, data):
    """A valid plan with one to three fields replaced, deleted or added: every reader
    accepts it or raises PlanError naming a field; an accepted plan renders its report."""
    name = data.draw(st.sampled_from(sorted(base_plans)))
    plan_data = base_plans[name]
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(plan_data) + [("unknown_field",), ("predicted", "new_kind")]
        path = data.draw(st.sampled_from(paths))
        value = data.draw(st.one_of(JSON_VALUES, st.just("DELETE")))
        try:
            plan_data = _mutate(plan_data, path, value)
        except (KeyError, IndexError, TypeError):  # the path no longer exists after a change
            continue
    model, traces = tiny_and_traces
    text = json.dumps(plan_data)
    try:
        plan = autopar.Plan.from_json(text, "mutated.json")
        check_plan(plan, source="mutated.json", executable=True)
        key = (plan.seq_len, plan.dtype)
        if key not in traces and plan.seq_len <= 16:
            traces[key] = trace_model(model, plan.seq_len, dtype=plan.dtype)
        check_plan_fits_model(plan, model, traces.get(key), source="mutated.json")
    except PlanError as exc:
        assert "mutated.json: plan field" in str(exc) and "\n" not in str(exc), exc
        door_counts("plan JSON (mutated)", False)
        return
    assert render_markdown(plan)  # the report reader renders what the validator accepts
    door_counts("plan JSON (mutated)", True)


@pytest.mark.parametrize("entry, field", [
    ({}, "alternatives[0]"), ({"feasible": True}, "alternatives[0]"),
    ({"layout": []}, "alternatives[0]"), ({"layout": {}, "feasible": [1]}, "alternatives[0].feasible"),
    ({"layout": {}, "min_memory_bytes": "x"}, "alternatives[0].min_memory_bytes")])
def test_an_alternative_the_plan_type_cannot_hold_is_a_plan_error(base_plans, entry, field):
    """Found by the door above in CI: an alternative without a layout object passed the
    validator and failed building :class:`~autopar.contract.plan.Alternative`."""
    plan_data = dict(next(iter(base_plans.values())), alternatives=[entry])
    with pytest.raises(PlanError, match=rf"plan field '{re.escape(field)}'"):
        autopar.Plan.from_json(json.dumps(plan_data), "mutated.json")


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_accepted_mutated_plans_reprice(door_counts, base_plans, data):
    """A sample of mutated plans: ``evaluate_plan`` re-prices an accepted one or refuses
    it with PlanError (the same validator), never an internal error."""
    name = data.draw(st.sampled_from(sorted(base_plans)))
    path = data.draw(st.sampled_from([("micro_batch_size",), ("num_micro_batches",),
                                      ("zero_stage",), ("recompute", 0), ("schedule",),
                                      ("stage_layers", 0), ("dp",), ("global_batch_size",)]))
    plan_data = _mutate(base_plans[name], path, data.draw(JSON_VALUES))
    model, _ = autopar.load_model("gpt-tiny")
    try:
        plan = autopar.Plan.from_dict(plan_data)
        autopar.evaluate_plan(model, autopar.Cluster.from_dict(plan.cluster), plan)
    except PlanError:
        door_counts("plan JSON, then evaluate_plan", False)
        return
    door_counts("plan JSON, then evaluate_plan", True)


@MANY
@given(layers=st.integers(1, 4), heads=st.sampled_from([1, 2, 4]),
       embd=st.sampled_from([16, 32]), vocab=st.sampled_from([32, 64]),
       block=st.sampled_from([8, 16, 32]), seq=st.sampled_from([8, 16, 17, 32]))
def test_model_mismatch_door(door_counts, base_plans, layers, heads, embd, vocab, block, seq):
    """A gpt-tiny plan (or the same with another seq_len) read against GPT variants: the
    model check refuses every model it was not made for with PlanError naming the field
    (model_config, seq_len ...), and accepts gpt-tiny's own shape."""
    plan = autopar.Plan.from_dict(dict(base_plans["tp2"], seq_len=seq))
    config = GPTConfig(n_layer=layers, n_head=heads, n_embd=embd, vocab_size=vocab,
                       block_size=block)
    tiny = config == GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)
    with torch.device("meta"):
        model = GPT(config)
    try:
        check_plan_fits_model(plan, model)
    except PlanError as exc:
        assert exc.field in ("model_config", "seq_len", "placements", "recompute"), exc
        door_counts("plan vs model", False)
        return
    assert tiny and seq <= 16
    door_counts("plan vs model", True)
