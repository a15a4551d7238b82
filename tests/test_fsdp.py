"""ZeRO-3 through FSDP2 (``autopar.runtime.fsdp``) on shapes FSDP2 must pad.

The matrix (test_matrix.py) runs ZeRO-3 on the test GPT, whose dimensions all divide d;
here the vocabulary (65 rows), the position table (17 rows) and the width (30) do not
divide d = 2 or 4 everywhere, so FSDP2 pads dim 0 of those parameters, and the predicted
all-gather / reduce-scatter bytes must still be exact. Also: units are per layer, the
gathered parameters are not counted as saved activations, ``autopar verify`` reads the
sharded (DTensor) gradients, and pp > 1 is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.fsdp import FullyShardedOptimizer, layer_units
from autopar.support import RUNTIME_SUPPORT
from autopar.graph.capture import trace_model
from autopar.verify.check import verify
from dist_utils import run_distributed
from test_parallelize import _cluster, _optimizer, _rel

ODD = GPTConfig(n_layer=2, n_head=3, n_embd=30, vocab_size=65, block_size=17)
BATCH, SEQ, STEPS = 8, 16, 2


def _odd_model() -> GPT:
    """Seeded, random biases (see test_parallelize._model: the key bias's gradient is 0)."""
    torch.manual_seed(0)
    model = GPT(ODD)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, ODD.vocab_size, (BATCH, SEQ), generator=g),
             torch.randint(0, ODD.vocab_size, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def _reference():
    model = _odd_model()
    optim = _optimizer("sgd")(model.parameters())
    losses = []
    for idx, tgt in _batches():
        _, loss = model(idx, tgt)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


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


def test_layer_units_group_rewritten_modules_by_layer():
    traced = trace_model(_odd_model(), SEQ)
    from autopar.rewrite.pipeline import annotate_chunks

    annotate_chunks(traced, [[0, ODD.n_layer]])
    units, rest = layer_units(traced.gm)
    assert len(units) == ODD.n_layer
    names = {id(m): n for n, m in traced.gm.named_modules()}
    assert all(names[id(m)].startswith(f"transformer.h.{l}.") for l, u in enumerate(units) for m in u)
    assert {names[id(m)] for m in rest} == {"transformer.wte", "transformer.wpe",
                                            "transformer.ln_f", "lm_head"}


def test_zero3_needs_fp32_master_weights_and_pp1():
    with pytest.raises(ValueError, match="keep the model in float32"):
        FullyShardedOptimizer(torch.fx.symbolic_trace(nn.Linear(2, 2).bfloat16()),
                              torch.optim.SGD, dp_mesh=None)
    assert 3 in RUNTIME_SUPPORT.zero_stages_for(1)
    assert 3 not in RUNTIME_SUPPORT.zero_stages_for(2)
