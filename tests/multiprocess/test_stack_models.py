"""Model definitions of other stacks, built on the meta device, on real gloo groups (issue 32).

A litgpt-style GPT (rotary ``cos``/``sin`` computed in the constructor, recomputed by its
``reset_parameters()``; LayerNorm left to its own initialisation by ``_init_weights``) and
a torchtitan-style Llama (one complex ``freqs_cis`` table on the model that every layer
reads, recomputed by ``init_weights(buffer_device)``; layers in an ``nn.ModuleDict``)
(``tests/stack_models.py``):

* plan and ``verify`` against one process at tp2, pp2 and tp2·pp2, from the meta device;
* ``parallelize`` from the meta device gives shards whose gathered state equals
  ``autopar.init_model`` of the same meta model, bit for bit;
* a looped-depth model (``LoopedLM``: every layer runs twice, captured by export, random
  input jitter in training) verifies at tp2 with Megatron's placements: both calls of a
  Linear train its one shard, and verify draws the jitter from the same RNG state on both
  sides;
* the same models built under ``autopar.meta_parameters()`` (parameters on meta, the
  buffers computed by the constructor) give the same shards.
"""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from dist_utils import run_distributed
from helpers import fast_cluster
from stack_models import LitStyleGPT, LoopedLM, StackConfig, TitanStyleLlama

CONFIG = StackConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32)
SEQ, BATCH, SEED = 16, 4, 3
MODELS = {"litgpt-style": LitStyleGPT, "torchtitan-style": TitanStyleLlama}
LAYOUTS = {"tp2": dict(tp=2, pp=1, dp=1), "pp2": dict(tp=1, pp=2, dp=1),
           "tp2·pp2": dict(tp=2, pp=2, dp=1)}


def _meta(name: str, how: str = "meta"):
    if how == "meta":
        with torch.device("meta"):
            return MODELS[name](CONFIG)
    with autopar.meta_parameters():
        return MODELS[name](CONFIG)


def _plan(name: str, layout: dict):
    world = layout["tp"] * layout["pp"] * layout["dp"]
    return autopar.plan(_meta(name), fast_cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(micro_batch_size=BATCH // 2 if layout["pp"] > 1
                                              else BATCH, **layout),
                        model_name=name)


def _rank(rank: int, world: int, cases: list) -> dict:
    from autopar.verify.check import verify

    out = {}
    for name, layout, plan in cases:
        report = verify(_meta(name), plan, steps=2, seed=SEED)
        states = {}
        for how in ("meta", "meta_parameters"):
            pm = autopar.parallelize(_meta(name, how), plan=plan, seed=SEED,
                                     optimizer=functools.partial(torch.optim.SGD, lr=0.1))
            states[how] = pm.full_state_dict()
        out[(name, layout)] = (report.to_dict(), states if rank == 0 else None)
    return out


def _cases(world: int) -> list:
    return [(name, layout, _plan(name, LAYOUTS[layout])) for name in MODELS
            for layout in LAYOUTS
            if LAYOUTS[layout]["tp"] * LAYOUTS[layout]["pp"] * LAYOUTS[layout]["dp"] == world]


@pytest.mark.parametrize("world", [2, 4])
def test_stack_models_verify_and_shard_like_init_model(world):
    cases = _cases(world)
    results = run_distributed(_rank, world, cases, timeout_s=600)
    for name, layout, _ in cases:
        report, states = results[0][(name, layout)]
        assert report["ok"] and report["max_loss_diff"] < 1e-5, (name, layout, report)
        want = autopar.init_model(_meta(name), SEED).state_dict()
        for how, state in states.items():
            assert set(state) == set(want), (name, layout, how, set(state) ^ set(want))
            unequal = [k for k, v in want.items() if not torch.equal(state[k], v)]
            assert unequal == [], (name, layout, how, unequal)


def _looped_rank(rank: int, world: int, plan) -> dict:
    from autopar.verify.check import verify

    torch.manual_seed(SEED)
    return verify(LoopedLM(LOOPED), plan, steps=2, seed=SEED, raise_on_failure=False).to_dict()


LOOPED = StackConfig(n_layer=2, n_head=4, n_embd=48, vocab_size=128, block_size=SEQ)


def test_looped_layers_verify_at_tp2():
    torch.manual_seed(SEED)
    plan = autopar.evaluate(LoopedLM(LOOPED), fast_cluster(2), autopar.Layout(
        tp=2, pp=1, dp=1, micro_batch_size=BATCH, dtype="fp32"), global_batch_size=BATCH,
        seq_len=SEQ)
    assert plan.placements["layers_0_feed_forward_w1_1"].startswith("column")  # the second call
    report = run_distributed(_looped_rank, 2, plan, timeout_s=300)[0]
    assert report["ok"] and report["max_grad_diff"] < 1e-5, report
