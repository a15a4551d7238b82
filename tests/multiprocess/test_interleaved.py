"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2) end to end.

* The plan cuts the 4-layer GPT into pp·v = 4 chunks of one layer; rank r runs chunks r
  and r + pp (rank 0: layers 0 and 2 plus the embedding, rank 1: layers 1 and 3 plus the
  head), visible in the parameter names each rank holds, and training equals one process.
* A plan whose m is not a multiple of pp is a ValueError naming the fix, raised before any
  collective (so the other ranks do not hang); the rules without processes:
  tests/unit/test_interleaved_rules.py.
"""

from __future__ import annotations

import dataclasses
import re

import autopar
from dist_utils import run_distributed
from helpers import CONFIG, SEQ, STEPS
from helpers import batches as _batches, interleaved_plan as _plan, optimizer as _optimizer
from helpers import reference as _reference, seeded_gpt as _model


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
