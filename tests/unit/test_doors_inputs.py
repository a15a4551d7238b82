"""Property tests (hypothesis) at the input doors: Layout and its flags, the ``autopar
plan`` command line, cluster JSON and the Python API's argument types.

The property, for every generated input: it ends in a typed error with its documented
exit code (2 bad input, 3 infeasible, 6 time limit), one line on stderr, no traceback, no
"internal error" and no output file left behind; or in a plan that the one plan
validator accepts as executable on this model (``check_plan(executable=True)`` and
``check_plan_fits_model``). A sample of such accepted plans runs through the real
``autopar verify`` in tests/multiprocess/test_verify_doors.py. The number of inputs each
door saw is printed at the end of the run (conftest.py).

Searches are memoised per distinct (layout, batch, seq_len, cluster) input: ``autopar.plan``
is deterministic, so the cache changes no outcome and keeps thousands of inputs within
seconds.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import autopar
from autopar.cli import commands as cli
from autopar.contract.plan_check import check_plan
from autopar.planner.plan_fit import check_plan_fits_model
from autopar.contract.support import check_pins
from autopar.techniques.pipeline_schedules import PIPELINE_SCHEDULES
from cost_models.hardware import Cluster

PROPERTY = settings(max_examples=1500, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
DOCUMENTED = {0, 2, 3, 6}  # exit codes `autopar plan` may end with (README, parser)

# mostly valid (None: free, small ints) so that accepted layouts are common, plus the wrong kinds
ints = st.sampled_from([None] * 8 + [1, 1, 2, 2, 4, 3, 0, -1, True, False, 2.0, "2", 64])


@PROPERTY
@given(tp=ints, pp=ints, dp=ints, mbs=ints, zero=ints,
       recompute=st.sampled_from([None] * 4 + ["none", "full", "selective", "all", 1]),
       schedule=st.sampled_from([None] * 4 + [*PIPELINE_SCHEDULES, "zb", 0]),
       v=ints, sp=st.sampled_from([None] * 4 + [True, False, 1, "yes"]),
       dtype=st.sampled_from([None] * 4 + ["bf16", "fp32", "fp16"]))
def test_layout_door(door_counts, tp, pp, dp, mbs, zero, recompute, schedule, v, sp, dtype):
    """Layout(...) is a Layout or a ValueError; bools and non-ints never pass as degrees;
    check_pins then accepts it or names the rule (ValueError)."""
    try:
        layout = autopar.Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, zero_stage=zero,
                                recompute=recompute, schedule=schedule, virtual_stages=v,
                                sequence_parallel=sp, dtype=dtype)
        check_pins(layout)
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
        door_counts("Layout(...) + check_pins", False)
        return
    for value in (tp, pp, dp, mbs, v, zero):
        assert value is None or (type(value) is int and value >= 0)
    door_counts("Layout(...) + check_pins", True)


@PROPERTY
@given(st.lists(st.sampled_from(["tp=2", "pp=1", "dp=4", "mbs=1", "zero=1", "v=2", "sp=true",
                                  "recompute=full", "tp=x", "pp", "=3", "dp=-1", "sp=maybe",
                                  "zero=9", "mbs=2.5", "foo=1", ""]), max_size=5)
       .map(",".join))
def test_layout_parse_door(door_counts, text):
    """Layout.parse of any text: a Layout or one ValueError naming the item."""
    try:
        autopar.Layout.parse(text)
    except ValueError as exc:
        assert "\n" not in str(exc)
        door_counts("Layout.parse", False)
        return
    door_counts("Layout.parse", True)


# --------------------------------------------------------------------- the CLI door
FLAG_VALUES = st.sampled_from(["-1", "0", "1", "2", "3", "4", "8", "x", "2.5", ""])
FLAGS = {"--tp": FLAG_VALUES, "--pp": FLAG_VALUES, "--dp": FLAG_VALUES, "--mbs": FLAG_VALUES,
         "--zero-stage": st.sampled_from(["0", "1", "2", "3", "4", "-1"]),
         "--recompute": st.sampled_from(["none", "full", "selective", "some"]),
         "--schedule": st.sampled_from([*PIPELINE_SCHEDULES, "zb"]),
         "--virtual-stages": FLAG_VALUES,
         "--seq-len": st.sampled_from(["8", "16", "17", "64", "0", "-4"]),
         "--dtype": st.sampled_from(["bf16", "fp32", "fp8"]),
         "--nodes": st.sampled_from(["1", "2", "0"]),
         "--time-limit": st.sampled_from(["1", "0.5", "0", "-1", "nan", "inf"])}


@pytest.fixture(scope="module")
def memo_plan(monkeypatch_module):
    """autopar.plan memoised on its inputs (deterministic, so outcomes are unchanged)."""
    real, cache = autopar.plan, {}

    def plan(model, cluster, *, global_batch_size, seq_len, layout=None, model_name="model",
             progress=None, time_limit_s=1.0, target="autopar"):
        key = (model_name, json.dumps(cluster.to_dict(), sort_keys=True), global_batch_size,
               seq_len, layout, time_limit_s, target)
        if key not in cache:
            try:
                cache[key] = real(model, cluster, global_batch_size=global_batch_size,
                                  seq_len=seq_len, layout=layout, model_name=model_name,
                                  time_limit_s=time_limit_s, target=target)
            except Exception as exc:  # noqa: BLE001 - replayed to the caller, typed or not
                cache[key] = exc
        if isinstance(cache[key], Exception):
            raise cache[key]
        return cache[key]
    monkeypatch_module.setattr(autopar, "plan", plan)
    return cache


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def tiny():
    model, _ = autopar.load_model("gpt-tiny")
    return model


@pytest.fixture(scope="module")
def tiny_traces() -> dict:
    """gpt-tiny's traces by (seq_len, dtype), as check_plan_fits_model returns them: one
    trace per key instead of one per accepted plan (as test_doors_plans' plan door)."""
    return {}


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``autopar`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_typed_failure(code: int, err: str, verb: str) -> None:
    """One line on stderr naming the verb, a documented code, no traceback or internal error."""
    assert code in DOCUMENTED - {0}, (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(("autopar " + verb, "usage:", "autopar: error")), err


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(flags=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), max_size=4)
       .flatmap(lambda d: st.fixed_dictionaries({k: FLAGS[k] for k in d})),
       batch=st.sampled_from(["8", "4", "6", "16", "1", "0", "-8", "x"]),
       sp=st.sampled_from([[], ["--sequence-parallel"], ["--no-sequence-parallel"]]))
def test_plan_cli_door(door_counts, memo_plan, tiny, tiny_traces, tmp_path_factory, flags, batch,
                      sp):
    """``autopar plan`` with generated flags: exit 0 with a plan file the validator accepts
    as executable for gpt-tiny, or a documented exit code, one line, no file written."""
    out = tmp_path_factory.mktemp("cli") / "plan.json"
    argv = ["plan", "--model", "gpt-tiny", "--cluster", "local-cpu",
            "--global-batch-size", batch, "-o", str(out)] + sp
    for flag, value in flags.items():
        argv += [flag, value]
    code, _, err = run_cli(argv)
    if code != 0:
        assert_typed_failure(code, err, "plan")
        assert not out.exists(), "a failed plan left its output file"
        door_counts("autopar plan (CLI flags)", False)
        return
    plan = autopar.Plan.from_json(out.read_text(), str(out))
    check_plan(plan, executable=True)
    key = (plan.seq_len, plan.dtype)
    tiny_traces[key] = check_plan_fits_model(plan, tiny, tiny_traces.get(key))
    door_counts("autopar plan (CLI flags)", True)


# ----------------------------------------------------------------- cluster JSON door
def _mutations():
    """(path into the cluster dict, new value or DELETE) pairs."""
    paths = [("device", "peak_tflops"), ("device", "memory_gib"), ("device", "name"),
             ("device", "matmul_efficiency"), ("device", "memory_bandwidth_gbps"),
             ("device", "op_overhead_s"), ("intra_node", "bandwidth_gbps"),
             ("inter_node", "latency_s"), ("gpus_per_node",), ("nodes",), ("dtype",),
             ("attention",), ("name",), ("device",), ("extra",)]
    values = st.one_of(st.none(), st.booleans(), st.integers(-2, 16),
                       st.sampled_from([0.0, 1e-9, 1e-300, 1e300, float("nan"), float("inf"),
                                        0.5, 2.0, "x", "", "bf16", "flash", [], {}, "DELETE"]))
    return st.tuples(st.sampled_from(paths), values)


@settings(max_examples=2000, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(_mutations(), min_size=1, max_size=3), st.integers(0, 15))
def test_cluster_json_door(door_counts, memo_plan, tiny, tmp_path_factory, edits, plan_it):
    """A cluster file mutated field by field: ``load_cluster`` gives a Cluster or a
    ValueError naming the field; an accepted cluster plans gpt-tiny or ends in a typed
    error (sampled: half the accepted clusters are planned through the CLI)."""
    data = Cluster.local_cpu(processes=2).to_dict()
    for path, value in edits:
        target = data
        for key in path[:-1]:
            target = target[key] if isinstance(target.get(key), dict) else {}
        if value == "DELETE":
            target.pop(path[-1], None)
        else:  # a copy: hypothesis hands the same sampled [] / {} to every example
            target[path[-1]] = copy.deepcopy(value)
    path = tmp_path_factory.mktemp("cluster") / "cluster.json"
    path.write_text(json.dumps(data))
    try:
        cluster = cli.load_cluster(str(path), None)
    except ValueError as exc:
        assert str(exc)
        door_counts("cluster JSON", False)
        return
    assert isinstance(cluster, Cluster)
    door_counts("cluster JSON", True)
    if plan_it == 0 and cluster.num_gpus <= 16:  # a sample: a search per accepted cluster
        code, _, err = run_cli(["plan", "--model", "gpt-tiny", "--cluster", str(path),
                                "--global-batch-size", "8", "--json"])
        if code != 0:
            assert_typed_failure(code, err, "plan")
        door_counts("cluster JSON, then autopar plan", code == 0)


# --------------------------------------------------------- the Python API's types
@settings(max_examples=1000, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(cluster=st.sampled_from(["local-cpu", "dgx-a100", "nope", 3, None, b"x", 1.5]),
       batch=st.sampled_from([8, 0, -8, 8.0, "8", True, None]),
       seq=st.sampled_from([16, 17, 0, -1, 16.0, None]),
       layout=st.sampled_from([None, autopar.Layout(), {"tp": 2}, "tp=2"]),
       limit=st.sampled_from([1.0, 0, -1.0, float("nan"), "1", True]))
def test_python_api_door(door_counts, tiny, cluster, batch, seq, layout, limit):
    """``autopar.plan``'s arguments are checked at the door: a wrong type is a TypeError
    saying what to pass, a bad value a ValueError (never an AttributeError from inside)."""
    from autopar.api import check_problem

    try:
        check_problem(tiny, cluster, global_batch_size=batch, seq_len=seq, layout=layout,
                      time_limit_s=limit)
    except (TypeError, ValueError) as exc:
        assert str(exc)
        door_counts("autopar.plan arguments", False)
        return
    door_counts("autopar.plan arguments", True)


def test_property_module_has_no_stale_outputs(tmp_path: Path):
    """A failed `plan -o FILE --report DIR` writes neither (the door checks run first)."""
    out, report = tmp_path / "p.json", tmp_path / "rep"
    code, _, err = run_cli(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu",
                            "--global-batch-size", "8", "--pp", "3", "-o", str(out),
                            "--report", str(report)])
    assert code == 2 and not out.exists() and not report.exists(), err
