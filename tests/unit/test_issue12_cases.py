"""Every case of issue 12 ("every input checked at the door, and a correctness check that
cannot be fooled"), each a test that failed before the fix. One process; the cases that
run local processes (a NaN program through ``autopar verify``, an edited tp=2 plan) are in
tests/multiprocess/test_verify_doors.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math

import pytest

import autopar
from autopar.cli import commands as cli
from autopar.contract.plan_check import PlanError, read_plan
from autopar.planner.search import search
from autopar.planner.search.outcome import SolverTimeLimitError, solver_status
from autopar.verify.result import NonFinite, ParamDiff, StepLoss, Tolerances, VerifyReport
from autopar.verify.claims import claim_problem
from helpers import tiny_plan


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


PLAN = ["plan", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size", "8"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A valid saved tp=2 plan's JSON data and its path."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(tiny_plan(2, 1).to_json())
    return json.loads(path.read_text()), path


# ------------------------------------------------------------------ verify and NaN
def _report(parallel: float, reference: float, grad: float = 0.0) -> VerifyReport:
    report = VerifyReport("tp=2 pp=1 dp=1 fp32", "SGD", 1, Tolerances())
    report.losses.append(StepLoss(0, parallel, reference,
                                  abs(parallel - reference) / max(abs(reference), 1e-30)))
    report.params["w"] = ParamDiff("w", [0], grad=[grad], param=[0.0])
    return report


@pytest.mark.parametrize("parallel,reference", [(math.nan, math.nan), (math.nan, 2.0),
                                                (math.inf, 2.0)])
def test_a_nan_difference_is_never_ok(parallel, reference):
    """max() dropped NaN: both sides NaN read as "OK, max diff 0.0"; one side NaN as ok."""
    report = _report(parallel, reference)
    assert not report.ok
    assert report.max_loss_diff == math.inf


def test_a_nan_gradient_difference_fails():
    assert not _report(2.0, 2.0, grad=math.nan).ok


def test_a_nonfinite_record_fails_and_is_named_first():
    report = _report(2.0, 2.0)
    report.nonfinite.append(NonFinite(1, "loss", "both sides", "parallel nan, single device nan"))
    assert not report.ok
    message = report.failure_message()
    assert "step 1: the loss is not finite on the both sides" in message
    assert json.dumps(report.to_dict(), allow_nan=False)  # strict JSON for --json


def test_an_edited_tp_plan_does_not_claim_what_it_runs():
    """tp=1 plan edited to tp=2 (placements made for tp=1, nothing sharded): verify's
    claim check refuses it (it verified as OK before)."""
    model, _ = autopar.load_model("gpt-tiny")
    plan = tiny_plan(1, 1, 2, 0)
    assert claim_problem(model, plan) == ""
    edited = dataclasses.replace(plan, tp=2, dp=1, num_micro_batches=plan.num_micro_batches * 2)
    assert "does not describe its own decisions" in claim_problem(model, edited)


# ------------------------------------------------------------- pins and the door
@pytest.mark.parametrize("flags,rule", [
    (["--zero-stage", "3", "--pp", "2"], "zero_stage=3 with pp=2"),
    (["--virtual-stages", "3"], "virtual_stages=3 is outside what the autopar runtime"),
    (["--seq-len", "64"], "seq_len=64 exceeds the model's 16 positions"),
    (["--schedule", "interleaved_1f1b"], "interleaved 1F1B"),
    (["--mbs", "3"], "micro_batch_size=3 does not divide"),
    (["--virtual-stages", "2", "--schedule", "1f1b"], "needs schedule 'interleaved_1f1b'"),
])
def test_pins_outside_the_runtime_are_refused_at_the_door(flags, rule, tmp_path):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(PLAN + flags + ["-o", str(out)])
    assert code == 2 and rule in err and not out.exists(), err


def test_zero3_alone_plans_without_a_pipeline(tmp_path):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(PLAN + ["--zero-stage", "3", "-o", str(out)])
    assert code == 0, err
    plan = read_plan(out, executable=True)
    assert plan.zero_stage == 3 and plan.pp == 1


def test_bad_batch_and_micro_batch_get_their_own_messages():
    model, _ = autopar.load_model("gpt-tiny")
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        autopar.plan(model, "local-cpu", global_batch_size=-8, seq_len=16)
    with pytest.raises(ValueError, match="micro_batch_size=3 does not divide"):
        autopar.plan(model, "local-cpu", global_batch_size=8, seq_len=16,
                     layout=autopar.Layout(micro_batch_size=3))


def test_layout_refuses_bools_and_a_cluster_name_is_accepted():
    with pytest.raises(ValueError, match="Layout.tp must be a positive int"):
        autopar.Layout(tp=True)
    model, _ = autopar.load_model("gpt-tiny")
    plan = autopar.plan(model, "local-cpu", global_batch_size=8, seq_len=16)
    assert plan.num_gpus == autopar.Cluster.from_name("local-cpu").num_gpus
    with pytest.raises(TypeError, match="cluster must be an autopar.Cluster or a preset name"):
        autopar.plan(model, 4, global_batch_size=8, seq_len=16)


# ---------------------------------------------------------------- saved plans
@pytest.mark.parametrize("edit,field", [
    ({"global_batch_size": 12}, "global_batch_size"),      # B != d·b·m
    ({"zero_stage": 7}, "zero_stage"),                      # "ZeRO stage 7" was rendered
    ({"recompute": ["none"]}, "recompute"),                 # too short a recompute list
    ({"stage_layers": [[0, 1]]}, "recompute"),
    ({"version": 1}, "version"),
    ({"predicted": {"step_time_s": 1.0}}, "predicted.tflops_per_gpu"),
])
def test_report_refuses_an_invalid_saved_plan(saved, tmp_path, edit, field):
    data, _ = saved
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(dict(data, **edit)))
    out = tmp_path / "report"
    code, _, err = run_cli(["report", str(path), "--out", str(out)])
    assert code == 2 and f"plan field '{field}'" in err and str(path) in err, err
    assert not out.exists(), "a failed report left a folder"


def test_missing_fields_json_errors_and_foreign_json_are_bad_input(saved, tmp_path):
    data, _ = saved
    cases = {"missing.json": json.dumps({k: v for k, v in data.items() if k != "placements"}),
             "broken.json": "{not json", "hello.json": '{"hello": 1}'}
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        code, _, err = run_cli(["report", str(path), "--out", str(tmp_path / "r")])
        assert code == 2 and "internal error" not in err and str(path) in err, err
        assert "version None" not in err
    with pytest.raises(PlanError, match="'placements' is missing"):
        read_plan(tmp_path / "missing.json")


def test_output_paths_that_cannot_be_written_are_bad_input(saved, tmp_path):
    _, plan_path = saved
    code, _, err = run_cli(PLAN + ["-o", str(tmp_path)])
    assert code == 2 and "is a directory" in err, err
    code, _, err = run_cli(["report", str(plan_path), "--out", str(plan_path / "x")])
    assert code == 2 and "is a file" in err, err


def test_verify_refuses_an_unexecutable_plan_before_any_process(saved, tmp_path):
    data, _ = saved
    path = tmp_path / "z3pp2.json"
    plan = tiny_plan(1, 2)
    path.write_text(json.dumps(dict(json.loads(plan.to_json()), zero_stage=3)))
    code, _, err = run_cli(["verify", str(path)])
    assert code == 2 and "plan field 'zero_stage'" in err, err


# ------------------------------------------------------------------ the solver
def test_a_time_limit_without_a_plan_is_not_out_of_memory():
    """CP-SAT stopped before any plan: SolverTimeLimitError (exit 6), never "no plan fits"."""
    from autopar.graph.capture import trace_model

    model, _ = autopar.load_model("gpt-1.3b")
    traced = trace_model(model, 2048)
    cluster = autopar.Cluster.dgx_a100(nodes=1)
    with pytest.raises(SolverTimeLimitError, match="not an out-of-memory verdict"):
        search(traced, cluster, 512, autopar.Layout(), time_limit_s=1e-9)


def test_a_plan_stopped_at_the_limit_says_feasible_with_its_gap():
    cfg_a, cfg_b = object(), object()
    status = solver_status(10.0, {cfg_a: "OPTIMAL", cfg_b: "FEASIBLE"}, {cfg_b: 8.0}, 5, 0.5)
    assert (status.status, status.stopped, status.gap) == ("FEASIBLE", 1, 0.2)
    assert "not proven optimal" in status.line() and "20.0%" in status.line()
    plan = dataclasses.replace(tiny_plan(1, 1, 1), solver=status)
    assert "FEASIBLE, not proven optimal" in plan.summary()
    from autopar.report import render_markdown

    assert "Not proven optimal" in render_markdown(plan)


def test_plan_files_are_byte_identical_for_the_same_inputs(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert run_cli(PLAN + ["--tp", "2", "-o", str(path)])[0] == 0
    assert a.read_bytes() == b.read_bytes()
    assert "solve" not in json.loads(a.read_text())["predicted"]
