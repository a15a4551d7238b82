"""A hand layout priced by ``autopar.evaluate`` runs as Megatron-LM's program and matches
one device under ``autopar.verify.check.verify``.

gpt-tiny (2 layers, 4 heads, h = 32) evaluated at tp=2 on two gloo processes and at
tp=2, pp=2 with full recompute on four: the plans carry Megatron's placements
(column-parallel QKV and MLP-in, row-parallel attention-out and MLP-out), and each rank's
program trains 3 SGD steps equal to the single-device model (loss and gradients within
1e-5). Without processes: tests/unit/test_evaluate_megatron.py.
"""

from __future__ import annotations

import torch

import autopar
from autopar.verify.check import verify
from dist_utils import run_distributed
from helpers import TINY_BATCH, TINY_SEQ, tiny_meta_gpt


def _evaluated(layout: str, world: int) -> autopar.Plan:
    return autopar.evaluate(tiny_meta_gpt(), autopar.Cluster.local_cpu(processes=world),
                            autopar.Layout.parse(layout), global_batch_size=TINY_BATCH,
                            seq_len=TINY_SEQ, model_name="gpt-tiny")


def _verify_worker(rank: int, world: int, plan_json: str) -> dict:
    plan = autopar.Plan.from_json(plan_json)
    torch.manual_seed(0)
    return verify(tiny_meta_gpt(), plan, steps=3).to_dict()


def _check(plan: autopar.Plan, world: int) -> None:
    p = plan.placements
    assert plan.solver.status == "EVALUATED" and plan.dtype == "fp32"
    for layer in range(2):
        assert p[f"transformer_h_{layer}_attn_c_q"] == "column:S2"
        assert p[f"transformer_h_{layer}_mlp_c_fc"] == "column:S2"
        assert p[f"transformer_h_{layer}_attn_c_proj"] == p[f"transformer_h_{layer}_mlp_c_proj"] == "row:P"
    results = run_distributed(_verify_worker, world, plan.to_json(), timeout_s=300)
    report = results[0]
    assert report["ok"], report
    assert report["max_loss_diff"] < 1e-5 and report["max_grad_diff"] < 1e-5, report
    assert len(report["losses"]) == 3
    assert all(r == report for r in results)  # every rank holds the same report


def test_evaluated_megatron_tp2_plan_matches_one_device():
    _check(_evaluated("tp=2,pp=1,dp=1,mbs=2", 2), 2)


def test_evaluated_megatron_tp2_pp2_recompute_plan_matches_one_device():
    plan = _evaluated("tp=2,pp=2,dp=1,mbs=2,recompute=full", 4)
    assert plan.stage_layers == [[0, 1], [1, 2]] and plan.recompute == ["full", "full"]
    _check(plan, 4)
