"""``autopar.verify`` without processes: tolerances, dropout switched off, a plan for
another model refused before any collective, the report's ordering and messages, and the
``verify`` verb's exit codes (the gloo runs and the CLI end to end:
tests/multiprocess/test_verify.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autopar
from autopar import cli
from autopar.cli import verify as cli_verify
from autopar.models import GPT, preset
from autopar.recipe import check_plan_matches
from autopar.verify.check import Tolerances, VerificationError, disable_dropout, verify
from autopar.verify.result import ParamDiff, StepLoss, VerifyReport
from helpers import tiny_meta_gpt as _meta_model, tiny_plan as _plan

CONFIG = preset("gpt-tiny")  # 2 layers, 4 heads, h = 32, V = 64, s = 16


@pytest.fixture(scope="module")
def plans() -> dict[str, autopar.Plan]:
    return {"tp2": _plan(2, 1), "pp2": _plan(1, 2)}


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
    with pytest.raises(RuntimeError, match="torch.distributed to be initialised"):
        verify(_meta_model(), plans["tp2"])  # a meta model is accepted (initialised from seed)


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


def _noisy_report(noise: float) -> VerifyReport:
    """A report whose only difference is a gradient of 4e-5 (past the 1e-5 tolerance), the
    fp32 reference's own rounding against fp64 measured as ``noise`` for it."""
    report = VerifyReport(layout="tp=2 pp=1 dp=1 fp32", optimizer="SGD", steps=1,
                          tolerances=Tolerances())
    report.losses = [StepLoss(0, 4.0, 4.0, 0.0)]
    report.params = {"lam": ParamDiff("lam", [0], [4e-5], [1e-7], [noise], [0.0])}
    return report


def test_a_difference_within_the_references_own_rounding_passes_and_past_it_fails():
    assert _noisy_report(1e-5).ok  # 4e-5 <= 8 x 1e-5
    report = _noisy_report(1e-6)  # 4e-5 > max(1e-5, 8e-6)
    assert not report.ok and report.failed_by_differences_only()
    assert "the fp32 reference's own rounding against fp64 is 1.0e-06" in report.failure_message()
    loss = _noisy_report(1e-5)
    loss.losses[0] = StepLoss(0, 4.0002, 4.0, 5e-5, noise=1e-6)  # past max(1e-5, 8e-6)
    assert not loss.ok and "loss differs by 5.0e-05" in loss.failure_message()
    loss.losses[0].noise = 1e-5
    assert loss.ok
    nan = _noisy_report(1e-5)
    nan.params["lam"].grad[0] = float("nan")  # never within any noise
    assert not nan.ok


def test_fp32_noise_is_the_reference_against_fp64():
    from autopar.verify.noise import fp32_noise

    model = GPT(CONFIG)
    batches = [(torch.randint(0, CONFIG.vocab_size, (2, 8)),) * 2 for _ in range(2)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    noise = fp32_noise(model, lambda p: torch.optim.SGD(p, lr=0.1), batches, floor=1e-3)
    assert len(noise) == 2 and set(noise[0][1]) == {k for k, _ in model.named_parameters()}
    assert all(0 <= loss < 1e-5 for loss, _, _ in noise)
    worst = max(max(g.values()) for _, g, _ in noise)
    assert 0 < worst < 1e-4  # fp32 rounding: present, and small
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched


def test_the_fp64_reference_of_grouped_mm_experts_runs_their_loop():
    """``torch._grouped_mm`` has no fp64 kernel; the noise run's fp64 twin runs the experts'
    own per-expert loop instead (DeepSeek-V4's noise could not be measured before)."""
    tf = pytest.importorskip("transformers")
    from autopar.verify.noise import fp32_noise

    cfg = tf.Qwen2MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=1, vocab_size=64, intermediate_size=64,
                            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    model = tf.Qwen2MoeForCausalLM(cfg)
    model.set_experts_implementation("grouped_mm")
    idx = torch.randint(0, 64, (2, 8))
    [(loss, grads, params)] = fp32_noise(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                         [(idx, idx)], 1e-6)
    assert model.config._experts_implementation == "grouped_mm"  # the model itself unchanged
    assert 0 <= loss < 1e-5 and 0 < max(grads.values()) < 1e-4, (loss, grads)
