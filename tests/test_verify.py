"""``autopar.verify.check``: the parallel program against one device, and the ``verify`` verb.

Real gloo process groups of 2 ranks: a tensor-parallel (Megatron placements) and a
pipeline plan of a 2-layer GPT must pass; the same plans with one TP all-reduce removed
or one weight of a pipeline stage perturbed must fail with a VerificationError naming
the stage (and the parameter). The CLI runs end to end in a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar import cli
from autopar.cli import verify as cli_verify
from autopar.models import GPT, preset
from autopar.runtime.tp_modules import ReduceFromTPRegion
from autopar.planner.megatron import megatron_placements
from autopar.graph.capture import trace_model
from autopar.verify.check import (Tolerances, VerificationError, check_plan_matches, disable_dropout,
                            verify)
from autopar.verify.result import ParamDiff, StepLoss, VerifyReport
from cost_models.hardware import Cluster
from dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
CONFIG = preset("gpt-tiny")  # 2 layers, 4 heads, h = 32, V = 64, s = 16
BATCH, SEQ = 8, 16
PERTURBED = "transformer.h.1.mlp.c_fc.weight"  # on pipeline stage 1 of the pp=2 plan


def _meta_model() -> GPT:
    with torch.device("meta"):
        return GPT(CONFIG)


def _plan(tp: int, pp: int, dp: int = 1, zero_stage: int = 0) -> autopar.Plan:
    """A world-2 fp32 plan of gpt-tiny; TP plans get Megatron's placements (real all-reduces)."""
    meta, cluster = _meta_model(), Cluster.local_cpu(processes=tp * pp * dp)
    plan = autopar.plan(meta, cluster, global_batch_size=BATCH, seq_len=SEQ, model_name="gpt-tiny",
                        layout=autopar.Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage))
    if tp > 1:
        plan = dataclasses.replace(plan, placements=megatron_placements(trace_model(meta, SEQ), tp))
        plan = autopar.evaluate_plan(meta, cluster, plan)
    assert plan.dtype == "fp32"
    return plan


@pytest.fixture(scope="module")
def plans() -> dict[str, autopar.Plan]:
    return {"tp2": _plan(2, 1), "pp2": _plan(1, 2),  # ZeRO-1/2 keep gradient slices only:
            "dp2-zero1": _plan(1, 1, 2, 1), "dp2-zero2": _plan(1, 1, 2, 2)}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


# ------------------------------------------------------------- wrong programs
def _drop_first_tp_all_reduce(pm) -> None:
    """Break the program: the first TP all-reduce (Megatron's g) becomes the identity."""
    gm = pm.stage_module
    node = next(n for n in gm.graph.nodes if n.op == "call_module"
                and isinstance(gm.get_submodule(n.target), ReduceFromTPRegion))
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()


def _perturb_one_weight(pm) -> None:
    """Break the program: one element of PERTURBED, on the rank that holds it."""
    params = dict(pm.stage_module.named_parameters())
    for name, spec in pm.shards.items():
        if spec.key == PERTURBED:
            with torch.no_grad():
                params[name][0, 0] += 0.05


def _broken(breaker):
    """``autopar.runtime.parallelize.parallelize`` that builds the program, then breaks it."""
    import autopar.runtime.parallelize as parallel

    original = parallel.parallelize

    def build(*args, **kwargs):
        pm = original(*args, **kwargs)
        breaker(pm)
        return pm
    return original, build


def _passing(rank: int, world: int, plans: dict) -> dict:
    out = {name: verify(_model(), plan).to_dict() for name, plan in plans.items()}
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = autopar.parallelize(model, plan=plans["tp2"], verify=True,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    out["untouched"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out["trains"] = pm.train_step(*torch.randint(0, CONFIG.vocab_size, (2, BATCH, SEQ)))
    return out


def _failing(rank: int, world: int, plans: dict) -> dict:
    import autopar.runtime.parallelize as parallel

    out = {}
    for name, breaker in (("tp2", _drop_first_tp_all_reduce), ("pp2", _perturb_one_weight)):
        original, broken = _broken(breaker)
        parallel.parallelize = broken
        try:
            verify(_model(), plans[name])
            out[name] = None
        except VerificationError as exc:
            out[name] = (str(exc), exc.report.to_dict())
        finally:
            parallel.parallelize = original
    return out


def test_verify_passes_on_tensor_and_pipeline_parallel_plans(plans):
    results = run_distributed(_passing, 2, plans, timeout_s=180)
    for name in plans:
        report = results[0][name]
        assert report["ok"], (name, report)
        assert report["max_loss_diff"] < 1e-5 and report["max_grad_diff"] < 1e-5, report
        assert len(report["losses"]) == 3 and len(report["params"]) == 36  # 2 layers x 16 + 4
        assert results[1][name] == report  # every rank holds the same report
    stages = {p["key"]: p["stages"] for p in results[0]["pp2"]["params"]}
    assert stages["transformer.wte.weight"] == [0, 1]  # tied with lm_head on the last stage
    assert stages["transformer.h.0.mlp.c_fc.weight"] == [0] and stages[PERTURBED] == [1]
    assert set(results[0]["pp2"]["stages"]) == {"0", "1"}
    assert all(r["untouched"] and r["trains"] > 0 for r in results)  # parallelize(verify=True)


def test_verify_fails_loudly_on_a_wrong_program(plans):
    results = run_distributed(_failing, 2, plans, timeout_s=180)
    for rank_result in results:
        message, report = rank_result["tp2"]  # g removed: partial sums flow on
        assert not report["ok"] and report["max_loss_diff"] > 1e-3, report["losses"]
        assert "autopar verify failed for tp=2 pp=1 dp=1 fp32" in message
        assert "pipeline stage 0" in message and "loss differs" in message
        message, report = rank_result["pp2"]
        assert f"parameter {PERTURBED!r} (pipeline stage 1): gradient differs" in message, message
        assert "at step 0" in message and report["params"][0]["key"] == PERTURBED


# ------------------------------------------------------------------ unit parts
def test_default_tolerances_follow_the_plan_dtype():
    assert Tolerances.for_dtype("fp32").loss == 1e-5
    assert Tolerances.for_dtype("bf16").param == 2e-2
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        Tolerances.for_dtype("fp8")
    with pytest.raises(ValueError, match="positive"):
        Tolerances(loss=0)


def test_disable_dropout_zeroes_modules_and_attention_probability():
    model = GPT(dataclasses.replace(CONFIG, dropout=0.1))
    changed = disable_dropout(model)
    assert "transformer.drop.p" in changed and "transformer.h.0.attn.dropout" in changed
    assert all(getattr(m, "p", 0.0) == 0.0 for m in model.modules())
    assert model.transformer.h[1].attn.dropout == 0.0


def test_plan_for_another_model_is_rejected_before_any_collective(plans):
    with torch.device("meta"):
        other = GPT(preset("gpt-small-test"))
    with pytest.raises(ValueError, match="different config"):
        check_plan_matches(other, plans["tp2"])
    with pytest.raises(ValueError, match="materialised"):
        verify(_meta_model(), plans["tp2"])  # no process group needed: fails first


def _failing_report() -> VerifyReport:
    report = VerifyReport(layout="tp=2 pp=2 dp=1 fp32", optimizer="SGD", steps=2,
                          tolerances=Tolerances())
    report.losses = [StepLoss(0, 4.0, 4.0, 0.0), StepLoss(1, 3.9, 3.8, 0.026)]
    report.params = {"a.weight": ParamDiff("a.weight", [0], [1e-7, 2e-7], [1e-7, 1e-7]),
                     "b.weight": ParamDiff("b.weight", [1], [1e-7, 0.3], [0.0, 0.01])}
    return report


def test_report_orders_worst_first_and_names_the_failure():
    report = _failing_report()
    assert not report.ok and report.max_grad_diff == 0.3
    assert [p.key for p in report.worst_params()] == ["b.weight", "a.weight"]
    assert report.by_stage()[1]["max_param_diff"] == 0.01
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["params"][0]["key"] == "b.weight"
    table = report.table()
    assert "FAILED" in table and table.index("b.weight") < table.index("a.weight")
    message = str(VerificationError(report))
    assert "'b.weight' (pipeline stage 1): gradient differs by 3.0e-01 relative at step 1" in message
    assert "loss differs by 2.6e-02 relative at step 1" in message
    assert isinstance(VerificationError(report), AssertionError)


# ------------------------------------------------------------------------ CLI
def test_cli_verify_end_to_end_json(plans, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(plans["tp2"].to_json())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "autopar", "verify", str(path), "--model",
                           "gpt-tiny", "--steps", "2", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["layout"] == "tp=2 pp=1 dp=1 fp32" and len(report["losses"]) == 2
    assert 0 < report["max_grad_diff"] < 1e-5  # a real TP program: rounding, not identical


def _run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_verify_bad_input_exits_2(plans, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(plans["tp2"].to_json())
    code, _, err = _run_cli(["verify", str(path), "--model", "gpt-small-test"], capsys)
    assert code == 2 and "different config" in err
    code, _, err = _run_cli(["verify", str(path), "--max-processes", "1"], capsys)
    assert code == 2 and "needs tp*pp*dp = 2*1*1 = 2 processes" in err
    code, _, err = _run_cli(["verify", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "does not exist" in err


def test_cli_verify_mismatch_exits_5(plans, tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text(plans["pp2"].to_json())
    report = _failing_report()
    outcome = {"ok": False, "report": report.to_dict(), "table": report.table(),
               "message": report.failure_message()}
    monkeypatch.setattr(cli_verify, "_spawn", lambda world, payload, timeout: outcome)
    code, out, err = _run_cli(["verify", str(path)], capsys)
    assert code == cli_verify.EXIT_VERIFY_FAILED == 5
    assert "FAILED" in out and "'b.weight' (pipeline stage 1)" in err
