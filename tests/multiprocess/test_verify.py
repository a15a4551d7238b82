"""``autopar.verify.check``: the parallel program against one device, and the ``verify`` verb.

Real gloo process groups of 2 ranks: a tensor-parallel (Megatron placements) and a
pipeline plan of a 2-layer GPT must pass; the same plans with one TP all-reduce removed
or one weight of a pipeline stage perturbed must fail with a VerificationError naming
the stage (and the parameter). The CLI runs end to end in a subprocess. The checks that
need no process: tests/unit/test_verify_units.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.models import GPT, preset
from autopar.runtime.tp_modules import ReduceFromTPRegion
from autopar.verify.check import VerificationError, verify
from dist_utils import run_distributed
from helpers import tiny_plan as _plan

ROOT = Path(__file__).resolve().parents[2]
CONFIG = preset("gpt-tiny")  # 2 layers, 4 heads, h = 32, V = 64, s = 16
BATCH, SEQ = 8, 16
PERTURBED = "transformer.h.1.mlp.c_fc.weight"  # on pipeline stage 1 of the pp=2 plan


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
    """``autopar.recipe.parallelize`` that builds the program, then breaks it."""
    import autopar.recipe as parallel

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
    import autopar.recipe as parallel

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
