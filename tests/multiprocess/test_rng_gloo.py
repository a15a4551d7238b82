"""Dropout under parallelism on real gloo processes (tp = 2).

Megatron's two properties: a dropout mask on a replicated tensor is the same on both TP
ranks, and one on a sharded tensor (attention heads, hidden/sequence shards) differs. Then:
one seed repeats a run bit for bit (tp, dp and pp), another seed changes it, and recompute
"full"/"selective" redraw exactly the masks of the forward (and do not without the tracker's
context_fn). All distributed runs share one world-2 launch (a module-scoped fixture) to stay
fast. The tracker, the dropout pass and recompute in one process: tests/unit/test_rng.py.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.graph.capture import trace_model
from autopar.models import GPT
from autopar.planner.strategies.megatron import megatron_placements
from autopar.rewrite.dropout import AttentionCore, ForkedRNG
from autopar.rewrite.recompute import apply_recompute
from dist_utils import run_distributed
from helpers import RNG_CONFIG as CONFIG, fast_cluster, rng_gpt as _model

BATCH, SEQ = 8, 16


_cluster = fast_cluster  # gpus_per_node = world (always 2 here)


def _plan(tp: int, pp: int, dp: int, recompute: str = "none", kind: str = "solver") -> autopar.Plan:
    with torch.device("meta"):
        meta = GPT(CONFIG)
    sp = {"megatron": False, "megatron-sp": True}.get(kind)
    layout = autopar.Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=2, recompute=recompute,
                            sequence_parallel=sp)
    plan = autopar.plan(meta, _cluster(2), global_batch_size=BATCH, seq_len=SEQ, layout=layout)
    if kind.startswith("megatron"):
        plan = dataclasses.replace(plan, placements=megatron_placements(
            trace_model(meta, SEQ), tp, sequence_parallel=plan.sequence_parallel))
    return plan


def _batches(steps: int):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g),
             torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g)) for _ in range(steps)]


def _train(plan, seed: int, steps: int) -> tuple[list[float], dict]:
    pm = autopar.parallelize(_model(), plan=plan, optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                             seed=seed)
    losses = [pm.train_step(idx, tgt) for idx, tgt in _batches(steps)]
    return losses, pm.full_state_dict()


def _masks(plan) -> dict[str, dict]:
    """One forward of a micro-batch with hooks: the zero pattern of each default-stream
    dropout and forked dropout, and each forked attention core's output next to the same
    core without dropout (the control: equal inputs on both ranks)."""
    pm = autopar.parallelize(_model(symmetric_heads=True), plan=plan,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1), seed=5)
    seen: dict[str, dict] = {}

    def hook(name, module, args, out):
        if isinstance(module, ForkedRNG) and isinstance(module.body, AttentionCore):
            kwargs = {k: v for k, v in module.body.kwargs.items() if k != "dropout_p"}
            seen[name] = {"kind": "forked_core", "out": out, "ref": F.scaled_dot_product_attention(*args, **kwargs)}
        else:
            seen[name] = {"kind": "forked" if isinstance(module, ForkedRNG) else "default", "mask": out == 0}

    for name, module in pm.stage_module.named_modules():
        if isinstance(module, ForkedRNG) or (isinstance(module, nn.Dropout) and not name.endswith(".body")):
            module.register_forward_hook(functools.partial(hook, name))
    with torch.no_grad():
        pm.stage_module(_batches(1)[0][0][:2])
    return seen


def _without_tracker_restore(gm, layer_nodes, recompute, tracker=None):
    return apply_recompute(gm, layer_nodes, recompute)  # the tracker is dropped on purpose


def _worker(rank: int, world: int, plans: dict) -> dict:
    out: dict = {"masks": {k: _masks(plans[k]) for k in ("megatron", "megatron-sp")}}
    for case in ("tp", "dp", "pp"):
        out[case] = [_train(plans[case], seed, 3)[0] for seed in (1, 1, 2)]
    out["recompute"] = {mode: _train(plans[mode], 1, 2) for mode in ("none", "full", "selective")}
    with mock.patch("autopar.rewrite.apply_recompute", _without_tracker_restore):
        out["no_restore"] = {mode: _train(plans[mode], 1, 2) for mode in ("full", "selective")}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    plans = {"megatron": _plan(2, 1, 1, kind="megatron"),
             "megatron-sp": _plan(2, 1, 1, kind="megatron-sp"),
             "tp": _plan(2, 1, 1), "dp": _plan(1, 1, 2), "pp": _plan(1, 2, 1)}
    for mode in ("none", "full", "selective"):
        plans[mode] = _plan(2, 1, 1, mode, kind="megatron")
    return run_distributed(_worker, 2, plans, timeout_s=300)


def test_replicated_masks_agree_and_sharded_masks_differ_across_tp(runs):
    counts = {"default": 0, "forked": 0, "forked_core": 0}
    for kind in ("megatron", "megatron-sp"):
        r0, r1 = runs[0]["masks"][kind], runs[1]["masks"][kind]
        assert set(r0) == set(r1) and r0
        for name, a in r0.items():
            b = r1[name]
            counts[a["kind"]] += 1
            if a["kind"] == "default":  # replicated: one mask for the whole TP group
                assert a["mask"].any() and torch.equal(a["mask"], b["mask"]), (kind, name)
            elif a["kind"] == "forked":  # a hidden/sequence shard: each rank its own mask
                assert a["mask"].any() and not torch.equal(a["mask"], b["mask"]), (kind, name)
            else:  # heads: the same q, k, v on both ranks, different dropout
                assert torch.allclose(a["ref"], b["ref"]), (kind, name)
                assert not torch.allclose(a["out"], b["out"]), (kind, name)
    # megatron: 5 replicated dropouts + 2 cores; megatron-sp: the 5 on sequence shards + 2 cores
    assert counts == {"default": 5, "forked": 5, "forked_core": 4}, counts


@pytest.mark.parametrize("case", ["tp", "dp", "pp"])
def test_same_seed_repeats_bitwise_and_another_seed_differs(runs, case):
    for rank_out in runs:
        first, again, other = rank_out[case]
        assert first == again, (case, first, again)
        assert all(a != b for a, b in zip(first, other)), (case, first, other)


def test_recompute_redraws_the_forward_masks(runs):
    rec = runs[0]["recompute"]
    losses, state = rec["none"]
    for mode in ("full", "selective"):
        got_losses, got_state = rec[mode]
        assert got_losses == losses, (mode, got_losses, losses)
        assert all(torch.equal(got_state[k], state[k]) for k in state), mode
        # without the tracker restore the forked masks are redrawn differently
        _, broken = runs[0]["no_restore"][mode]
        assert not all(torch.equal(broken[k], state[k]) for k in state), mode
