"""A model whose layers differ, planned as groups (autopar.graph.layer_groups) and cut into
pipeline stages, trains like one process: DeepSeek-V3 with a dense first layer
(``first_k_dense_replace=1``; the dense layer joins the first stage's prelude, the two MoE
layers are the two groups) at pp = 2 on 2 gloo ranks."""

from __future__ import annotations

import pytest

from helpers import load_script

SWITCHES = dict(first_k_dense_replace=1)
LAYERS, SEQ, BATCH = 3, 16, 8


def _deepseek():
    """The zoo's tiny DeepSeek-V3 with 3 layers, the first dense (benchmarks/hf_families.py
    with its every-layer-MoE switch overridden; a rank builds its own)."""
    hf = load_script("benchmarks/hf_families.py")
    from benchmarks.model_zoo import TINY

    hf.MOE_EVERY_LAYER = {**hf.MOE_EVERY_LAYER, **SWITCHES}
    return hf, hf.build_family("deepseek_v3", d={**TINY, "layers": LAYERS})


def _verify_rank(rank: int, world: int, plan) -> dict:
    from autopar.verify.check import verify

    return verify(_deepseek()[1], plan).to_dict()


def test_deepseek_dense_first_layer_verifies_at_pp2():
    pytest.importorskip("transformers")
    import autopar
    from autopar.runtime.launch import launch

    hf, model = _deepseek()
    plan = autopar.plan(model, hf.tiny_cluster(2), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(tp=1, pp=2, dp=1), model_name="deepseek_v3")
    assert plan.stage_layers == [[0, 1], [1, 2]]  # groups: module layers 1 and 2
    report = launch(_verify_rank, 2, plan, timeout_s=300, pg_timeout_s=60)[0]
    assert report["ok"] and report["max_grad_diff"] < 1e-5, report
