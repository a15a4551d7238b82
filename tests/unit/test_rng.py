"""Dropout under parallelism in one process: the RNG tracker, the dropout pass, recompute.

The tracker's streams fork and restore; the dropout pass forks exactly the dropouts on
sharded tensors; recompute redraws the forked masks of the forward. Megatron's mask
properties and reproducibility on real gloo processes: tests/multiprocess/test_rng_gloo.py.
"""

from __future__ import annotations

import pytest
import torch

from autopar.models import GPT
from autopar.rewrite.pipeline import annotate_chunks
from autopar.rewrite.dropout import AttentionCore, ForkedRNG, apply_dropout_rng
from autopar.contract.placement import parse_strategy_key
from autopar.rewrite.recompute import Checkpointed, apply_recompute
from autopar.runtime.rng import TENSOR_PARALLEL, RNGStatesTracker, rank_seeds, seed_rank
from autopar.planner.strategies.megatron import megatron_placements
from autopar.graph.capture import trace_model
from helpers import RNG_CONFIG as CONFIG, rng_gpt as _model

SEQ = 16


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


