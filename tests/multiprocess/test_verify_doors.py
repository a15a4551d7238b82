"""``autopar verify`` cannot be fooled (issue 12), end to end on local gloo processes.

* a NaN program (SGD with lr = nan, or a huge lr that overflows) fails with exit code 5
  and a message naming the first non-finite step; before, Python's ``max`` dropped the NaN
  and verify printed "OK, max diff 0.0";
* a tp=1 plan edited to tp=2 (nothing sharded, the prediction of another program) fails
  with exit 5 before any process starts;
* a sample of plans accepted at the CLI door (the property of
  tests/unit/test_doors_inputs.py) runs through the real verify and matches one device.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import run_cli, tiny_plan

PLAN = ["plan", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size", "8"]


@pytest.fixture(scope="module")
def dp2_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "dp2.json"
    path.write_text(tiny_plan(1, 1, 2).to_json())
    return path


@pytest.mark.parametrize("lr,step", [("nan", 0), ("1e30", None)])
def test_a_nan_program_fails_verify_with_exit_5(dp2_plan, lr, step):
    code, out, err = run_cli(["verify", str(dp2_plan), "--lr", lr, "--steps", "3"])
    assert code == 5, (out, err)
    assert "not finite" in err and "first non-finite step" in err, err
    if step is not None:
        assert f"step {step}:" in err, err
    assert "OK" not in out.splitlines()[0]


def test_an_edited_tp2_plan_fails_verify(tmp_path):
    plan = tiny_plan(1, 1, 2)
    edited = dataclasses.replace(plan, tp=2, dp=1,
                                 num_micro_batches=plan.num_micro_batches * 2)
    path = tmp_path / "edited.json"
    path.write_text(edited.to_json())
    code, _, err = run_cli(["verify", str(path)])
    assert code == 5 and "does not describe its own decisions" in err, err


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2", "--schedule", "gpipe"],
                                   ["--zero-stage", "3"]])
def test_plans_accepted_at_the_door_verify(tmp_path, flags):
    path = tmp_path / "plan.json"
    code, _, err = run_cli(PLAN + flags + ["-o", str(path)])
    assert code == 0, err
    code, out, err = run_cli(["verify", str(path), "--json"])
    assert code == 0, (out, err)
    assert json.loads(out)["ok"] is True
