"""ZeRO-3 through FSDP2 (``autopar.runtime.fsdp``) on shapes FSDP2 must pad.

The matrix (test_matrix.py) runs ZeRO-3 on the test GPT, whose dimensions all divide d;
here the vocabulary (65 rows), the position table (17 rows) and the width (30) do not
divide d = 2 or 4 everywhere, so FSDP2 pads dim 0 of those parameters, and the predicted
all-gather / reduce-scatter bytes must still be exact. Also: units are per layer, the
gathered parameters are not counted as saved activations, ``autopar verify`` reads the
sharded (DTensor) gradients, and pp > 1 is refused.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

import autopar
from autopar.models import GPT
from autopar.verify.check import verify
from dist_utils import run_distributed
from helpers import ODD, batches, reference, seeded_gpt
from helpers import fast_cluster as _cluster, optimizer as _optimizer, rel as _rel

BATCH, SEQ, STEPS = 8, 16, 2


def _odd_model() -> GPT:
    return seeded_gpt(ODD)  # random biases: the key bias's gradient is exactly 0


def _batches():
    return batches(STEPS, ODD, BATCH, SEQ, seed=7)


def _reference():
    return reference("sgd", ODD, STEPS, seed=7)


def _plan(world: int, dp: int, recompute: str) -> str:
    with torch.device("meta"):
        meta = GPT(ODD)
    layout = autopar.Layout(tp=world // dp, pp=1, dp=dp, micro_batch_size=2, zero_stage=3,
                            recompute=recompute)
    return autopar.plan(meta, _cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=layout).to_json()


def _worker(rank: int, world: int, plans: list[str]):
    out = []
    for text in plans:
        plan = autopar.Plan.from_json(text)
        pm = autopar.parallelize(_odd_model(), plan=plan, optimizer=_optimizer("sgd"))
        losses = [pm.train_step(idx, tgt) for idx, tgt in _batches()]
        units = {id(fully_shard.state(m)) for m in pm.stage_module.modules()
                 if isinstance(m, FSDPModule)}
        report = verify(_odd_model(), plan, raise_on_failure=False)  # DTensor gradients
        out.append({"losses": losses, "stats": pm.last_step_stats(), "units": len(units),
                    "predicted": plan.predicted.stage_stats[0], "state": pm.full_state_dict(),
                    "verified": report.to_dict()})
    return out


def test_zero3_pads_uneven_parameters_and_predicts_exact_bytes():
    plans = [_plan(2, 2, "none"), _plan(4, 4, "full")]
    per_rank = run_distributed(_worker, 2, plans[:1], timeout_s=600)
    per_rank += run_distributed(_worker, 4, plans[1:], timeout_s=600)
    ref_losses, ref_state = _reference()
    for results in per_rank:
        for r in results:
            measured, predicted = r["stats"], r["predicted"]
            for kind, nbytes in measured["comm_bytes"].items():
                assert nbytes == predicted["comm_bytes"][kind], (kind, measured, predicted)
            assert measured["comm_bytes"]["dp_all_gather"] > 0
            assert r["units"] == ODD.n_layer + 1  # one per layer + the root
            assert r["verified"]["ok"], r["verified"]
            for got, want in zip(r["losses"], ref_losses):
                assert abs(got - want) / abs(want) < 1e-5, (r["losses"], ref_losses)
            for key, want in ref_state.items():
                assert _rel(r["state"][key], want) < 1e-5, key
    saved = per_rank[0][0]["stats"]["saved_activation_bytes"]  # recompute none
    expected = per_rank[0][0]["predicted"]["saved_activation_bytes"]
    assert abs(saved / expected - 1) < 0.10, (saved, expected)
