"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2) end to end.

* The plan cuts the 4-layer GPT into pp·v = 4 chunks of one layer; rank r runs chunks r
  and r + pp (rank 0: layers 0 and 2 plus the embedding, rank 1: layers 1 and 3 plus the
  head), visible in the parameter names each rank holds, and training equals one process.
* A plan whose m is not a multiple of pp is a ValueError naming the fix, raised before any
  collective (so the other ranks do not hang).
* The search offers interleaving only where the shared rule allows it.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import autopar
from autopar.models import GPT
from autopar.support import check_executable, interleaving_problem
from autopar.planner.search import candidate_configs
from autopar.graph.capture import trace_model
from dist_utils import run_distributed
from test_parallelize import BATCH, CONFIG, SEQ, STEPS, _batches, _cluster, _model, _optimizer, _reference

LAYOUT = dict(tp=1, pp=2, dp=1, micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=2,
              recompute="none", dtype="fp32")


def _plan(world: int = 2, **layout) -> autopar.Plan:
    with torch.device("meta"):
        meta = GPT(CONFIG)
    return autopar.plan(meta, _cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(**{**LAYOUT, **layout}))


def _chunks_worker(rank: int, world: int, plan_json: str) -> dict:
    plan = autopar.Plan.from_json(plan_json)
    bad = dataclasses.replace(plan, global_batch_size=3, num_micro_batches=3)
    try:
        autopar.parallelize(_model(), plan=bad, optimizer=_optimizer("sgd"))
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    pm = autopar.parallelize(_model(), plan=plan, optimizer=_optimizer("sgd"))
    losses = [pm.train_step(idx, tgt) for idx, tgt in _batches(STEPS)]
    keys = sorted(spec.key for spec in pm.shards.values())
    stats = pm.last_step_stats()
    return {"error": error, "keys": keys, "losses": losses, "chunks": len(pm.chunks),
            "p2p": stats["comm_bytes"]["pp_p2p"],
            "predicted_p2p": plan.predicted.stage_stats[pm.groups.pp_rank]["comm_bytes"]["pp_p2p"]}


def test_each_rank_runs_chunks_round_robin_and_matches_one_process():
    plan = _plan()
    assert plan.stage_layers == [[0, 1], [1, 2], [2, 3], [3, 4]]
    results = run_distributed(_chunks_worker, 2, plan.to_json(), timeout_s=300)
    layers = [{int(m.group(1)) for k in r["keys"] if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
              for r in results]
    assert layers == [{0, 2}, {1, 3}]
    assert any(k.startswith("transformer.wte") for k in results[0]["keys"])
    assert any(k.startswith("transformer.ln_f") for k in results[1]["keys"])
    for r in results:
        assert r["chunks"] == 2
        assert "num_micro_batches divisible by pp" in r["error"] and "m=3" in r["error"], r["error"]
        # rank 0 sends 3 of the 4 boundary crossings per micro-batch each way: 2v - 1
        assert r["p2p"] == r["predicted_p2p"] == 3 * 8 * (1 * SEQ * CONFIG.n_embd * 4)
    want = _reference("sgd")[0]
    for r in results:
        assert r["losses"] == results[0]["losses"]
        for got, ref in zip(r["losses"], want):
            assert abs(got - ref) / abs(ref) < 1e-5, (r["losses"], want)


def test_invalid_interleaved_plans_are_clear_errors_without_processes():
    plan = _plan()
    check_executable(plan)
    with pytest.raises(ValueError, match=r"m=3, pp=2; choose m in multiples of 2"):
        check_executable(dataclasses.replace(plan, num_micro_batches=3))
    with pytest.raises(ValueError, match=r"needs schedule 'interleaved_1f1b'"):
        check_executable(dataclasses.replace(plan, schedule="1f1b"))
    with pytest.raises(ValueError, match=r"4 entries but pp\*v = 2\*1 = 2"):
        check_executable(dataclasses.replace(plan, virtual_stages=1))
    assert "not divisible by 8" in interleaving_problem(4, 4, 2, 8)
    assert "pp > 1" in interleaving_problem(4, 1, 2, 8)


def test_search_offers_interleaving_only_where_valid():
    with torch.device("meta"):
        traced = trace_model(GPT(CONFIG), SEQ)
    configs = candidate_configs(traced, _cluster(4), BATCH, autopar.Layout())
    interleaved = [c for c in configs if c.schedule == "interleaved_1f1b"]
    assert interleaved, "pp=2 with 4 layers and m % 2 == 0 should be offered"
    for c in configs:
        if c.schedule == "interleaved_1f1b":
            assert interleaving_problem(CONFIG.n_layer, c.pp, c.virtual_stages,
                                        c.num_micro_batches) is None, c
            assert c.pp > 1 and c.virtual_stages == 2 and CONFIG.n_layer % (2 * c.pp) == 0
        else:
            assert c.virtual_stages == 1, c
    assert not any(c.pp == 4 for c in interleaved)  # 8 chunks of a 4-layer model
