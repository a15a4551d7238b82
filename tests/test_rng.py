"""Dropout under parallelism: the RNG tracker, the dropout pass, recompute, reproducibility.

Megatron's two properties are tested directly on real gloo processes (tp = 2): a dropout
mask on a replicated tensor is the same on both TP ranks, and one on a sharded tensor
(attention heads, hidden/sequence shards) differs. Then: one seed repeats a run bit for
bit (tp, dp and pp), another seed changes it, and recompute "full"/"selective" redraw
exactly the masks of the forward (and do not without the tracker's context_fn).
All distributed runs share one world-2 launch (a module-scoped fixture) to stay fast.
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
from autopar.models import GPT, GPTConfig
from autopar.rewrite.pipeline import annotate_chunks
from autopar.rewrite.dropout import AttentionCore, ForkedRNG, apply_dropout_rng
from autopar.placement import parse_strategy_key
from autopar.rewrite.recompute import Checkpointed, apply_recompute
from autopar.runtime.rng import TENSOR_PARALLEL, RNGStatesTracker, rank_seeds, seed_rank
from autopar.planner.megatron import megatron_placements
from autopar.graph.capture import trace_model
from cost_models.hardware import Cluster, LinkSpec
from dist_utils import run_distributed

CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16, dropout=0.3)
BATCH, SEQ = 8, 16


# ---------------------------------------------------------------- the tracker alone

def test_fork_restores_default_stream_and_streams_advance_independently():
    tracker = RNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 12)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        a1 = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream did not move
    with tracker.fork("b"):
        b1 = torch.rand(4)
    with tracker.fork("a"):
        a2 = torch.rand(4)  # continues stream a where it stopped
    assert torch.equal(torch.cat([a1, a2]), torch.rand(8, generator=torch.Generator().manual_seed(11)))
    assert torch.equal(b1, torch.rand(4, generator=torch.Generator().manual_seed(12)))
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0)))

    saved = tracker.get_states()
    with tracker.fork("a"):
        x = torch.rand(5)
    tracker.set_states(saved)  # rewind stream a
    with tracker.fork("a"):
        assert torch.equal(torch.rand(5), x)
    with pytest.raises(ValueError, match="already"):
        tracker.add("a", 99)
    with pytest.raises(ValueError, match="seed 12"):
        tracker.add("c", 12)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("c"):
            pass


def test_fork_restores_default_stream_after_an_exception():
    tracker = RNGStatesTracker()
    tracker.add(TENSOR_PARALLEL, 5)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError):
        with tracker.fork():
            torch.rand(3)
            raise RuntimeError("inside the fork")
    assert torch.equal(torch.get_rng_state(), before)


def test_rank_seeds_follow_megatron():
    s = rank_seeds(1234, tp_rank=0, pp_rank=0)
    assert s.default == 1234 and s.tensor_parallel == 1234 + 2718
    assert rank_seeds(1234, tp_rank=3, pp_rank=2).default == 1234 + 200
    assert rank_seeds(1234, tp_rank=3, pp_rank=2).tensor_parallel == 1234 + 200 + 2718 + 3
    tracker = seed_rank(7, tp_rank=1, pp_rank=0)
    assert tracker.seeds == {TENSOR_PARALLEL: 7 + 2718 + 1}
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(7)))


# ---------------------------------------------------------------- the pass, in one process

def _model(symmetric_heads: bool = False) -> GPT:
    """The test GPT. symmetric_heads: the Q/K/V weights of heads 2-3 copy heads 0-1, so
    both TP ranks of tp = 2 feed identical q, k, v to their attention core."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if symmetric_heads:
        half = CONFIG.n_embd // 2
        with torch.no_grad():
            for block in model.transformer.h:
                for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                    lin.weight[half:] = lin.weight[:half]
                    lin.bias[half:] = lin.bias[:half]
    return model


def _sp_like_placements(traced) -> dict[str, str]:
    """Megatron's tp = 2 placements with the residual dropouts made sequence-sharded,
    as sequence parallelism will place them."""
    placements = megatron_placements(traced, 2)
    for name in placements:
        if name.endswith(("resid_dropout", "mlp_dropout")):
            placements[name] = "sharded:S1"
    return placements


def _traced(model: GPT | None = None):
    traced = trace_model(model if model is not None else _model(), SEQ)
    annotate_chunks(traced, [(0, CONFIG.n_layer)])
    return traced


def test_dropout_pass_forks_exactly_the_sharded_dropouts():
    traced = _traced()
    placements = _sp_like_placements(traced)
    tracker = seed_rank(0, tp_rank=0, pp_rank=0)
    forked = apply_dropout_rng(traced.gm, placements, tracker)
    sharded = sorted(n for n, k in placements.items() if "drop" in n or "attention" in n
                     if parse_strategy_key(k).output.is_sharded)
    assert sorted(forked) == sharded and len(sharded) == 6, forked
    assert parse_strategy_key(placements["transformer_drop"]).output.is_replicated  # stays on the default stream
    code = traced.gm.code
    assert "self.tp_rng_scaled_dot_product_attention(" in code
    assert "self.tp_rng_transformer_h_1_mlp_dropout(" in code
    assert "self.transformer.drop(" in code
    apply_recompute(traced.gm, [[n.name for n in traced.gm.graph.nodes if n.meta.get("autopar_layer") == l]
                                for l in range(2)], ["selective", "none"], tracker=tracker)
    core = traced.gm.get_submodule("recompute_attention_0_scaled_dot_product_attention")
    assert isinstance(core, Checkpointed) and isinstance(core.body, ForkedRNG)
    assert isinstance(core.body.body, AttentionCore) and core.tracker is tracker


def _grads_one_process(recompute: str, tracker_to_recompute: bool) -> dict[str, torch.Tensor]:
    """Every dropout forked (as if sharded), every layer recomputed: the gradients."""
    model = _model()
    traced = _traced(model)  # its graph calls model's modules: the gradients land on model
    placements = {n: "sharded:S1" for n in _sp_like_placements(traced)}
    tracker = seed_rank(3, tp_rank=0, pp_rank=0)
    gm = traced.gm
    apply_dropout_rng(gm, placements, tracker)
    layers = [[n.name for n in gm.graph.nodes if n.meta.get("autopar_layer") == l] for l in range(2)]
    apply_recompute(gm, layers, [recompute] * 2, tracker=tracker if tracker_to_recompute else None)
    idx = torch.randint(0, CONFIG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    gm(idx).square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_redraws_forked_masks_in_one_process(recompute):
    want = _grads_one_process("none", True)
    got = _grads_one_process(recompute, True)
    assert all(torch.equal(got[n], want[n]) for n in want)
    broken = _grads_one_process(recompute, False)  # no context_fn: the stream moved on
    assert not all(torch.equal(broken[n], want[n]) for n in want)


# ---------------------------------------------------------------- real processes, world 2

def _cluster(world: int) -> Cluster:
    a100 = Cluster.dgx_a100(1)
    fast = LinkSpec(name="ideal", bandwidth_gbps=1e6, latency_s=1e-12,
                    source="test: communication nearly free, so TP pays off on a tiny model")
    return Cluster(device=a100.device, gpus_per_node=2, nodes=1, intra_node=fast,
                   inter_node=fast, name="test", dtype="fp32", attention="flash")


def _plan(tp: int, pp: int, dp: int, recompute: str = "none", kind: str = "solver") -> autopar.Plan:
    with torch.device("meta"):
        meta = GPT(CONFIG)
    layout = autopar.Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=2, recompute=recompute)
    plan = autopar.plan(meta, _cluster(2), global_batch_size=BATCH, seq_len=SEQ, layout=layout)
    if kind == "megatron":
        plan = dataclasses.replace(plan, placements=megatron_placements(trace_model(meta, SEQ), tp))
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
    out: dict = {"masks": {k: _masks(plans[k]) for k in ("megatron", "solver")}}
    for case in ("tp", "dp", "pp"):
        out[case] = [_train(plans[case], seed, 3)[0] for seed in (1, 1, 2)]
    out["recompute"] = {mode: _train(plans[mode], 1, 2) for mode in ("none", "full", "selective")}
    with mock.patch("autopar.rewrite.apply_recompute", _without_tracker_restore):
        out["no_restore"] = {mode: _train(plans[mode], 1, 2) for mode in ("full", "selective")}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    plans = {"megatron": _plan(2, 1, 1, kind="megatron"), "solver": _plan(2, 1, 1),
             "tp": _plan(2, 1, 1), "dp": _plan(1, 1, 2), "pp": _plan(1, 2, 1)}
    for mode in ("none", "full", "selective"):
        plans[mode] = _plan(2, 1, 1, mode, kind="megatron")
    return run_distributed(_worker, 2, plans, timeout_s=300)


def test_replicated_masks_agree_and_sharded_masks_differ_across_tp(runs):
    counts = {"default": 0, "forked": 0, "forked_core": 0}
    for kind in ("megatron", "solver"):
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
    # megatron: 5 replicated dropouts + 2 cores; solver: also the 4 residual dropouts sharded
    assert counts == {"default": 5 + 1, "forked": 4, "forked_core": 4}, counts


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
