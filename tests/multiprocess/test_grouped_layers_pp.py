"""Models whose layers differ, planned as groups (autopar.graph.layer_groups) and cut into
pipeline stages, train like one process at pp = 2 on 2 gloo ranks: DeepSeek-V3 with a dense
first layer (``first_k_dense_replace=1``: the dense layer joins the first stage's prelude,
the two MoE layers are the two groups) and Qwen2-MoE with experts on every second of 5
layers (``decoder_sparse_step=2``: two groups of (dense, MoE), the fifth layer joins the
last stage's head; under full recompute, each group of two layers is one checkpoint)."""

from __future__ import annotations

import pytest

from helpers import load_script

CASES = {"deepseek_v3": (3, dict(first_k_dense_replace=1)),
         "qwen2_moe": (5, dict(decoder_sparse_step=2))}
RECOMPUTE = {"deepseek_v3": "none", "qwen2_moe": "full"}  # full: a group is one checkpoint
SEQ, BATCH = 16, 8


def _model(model_type: str):
    """The zoo's tiny ``model_type`` with :data:`CASES`' layers and switches
    (benchmarks/hf_families.py with its every-layer-MoE switches overridden; a rank builds
    its own)."""
    hf = load_script("benchmarks/hf_families.py")
    from benchmarks.model_zoo import TINY

    layers, switches = CASES[model_type]
    hf.MOE_EVERY_LAYER = {**hf.MOE_EVERY_LAYER, **switches}
    return hf, hf.build_family(model_type, d={**TINY, "layers": layers})


def _verify_rank(rank: int, world: int, model_type: str, plan) -> dict:
    from autopar.verify.check import verify

    return verify(_model(model_type)[1], plan).to_dict()


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_grouped_layers_verify_at_pp2(model_type):
    pytest.importorskip("transformers")
    import autopar
    from autopar.runtime.launch import launch

    hf, model = _model(model_type)
    plan = autopar.plan(model, hf.tiny_cluster(2), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(tp=1, pp=2, dp=1, recompute=RECOMPUTE[model_type]),
                        model_name=model_type)
    assert plan.stage_layers == [[0, 1], [1, 2]]  # two groups, one per stage
    report = launch(_verify_rank, 2, model_type, plan, timeout_s=300, pg_timeout_s=60)[0]
    assert report["ok"] and report["max_grad_diff"] < 1e-5, report
