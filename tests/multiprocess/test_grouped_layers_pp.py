"""Models whose layers differ, planned as groups (autopar.graph.layer_groups), train like
one process on 2 gloo ranks: DeepSeek-V3 with a dense first layer (``first_k_dense_replace=1``:
the dense layer joins the first stage's prelude, the two MoE layers are the two groups) at
pp = 2; Qwen2-MoE with experts on every second of 5 layers (``decoder_sparse_step=2``: two
groups of (dense, MoE), the fifth layer joins the last stage's head) at pp = 2 under full
recompute (each group one checkpoint); Qwen2-MoE with a dense first layer
(``mlp_only_layers=[0]``) at tp = 2 with sequence parallelism (the prelude's dense layer
split as the solver chose)."""

from __future__ import annotations

import pytest

from helpers import load_script

CASES = {  # name: model type, layers, switches, layout, the plan's stage_layers
    "deepseek_v3": ("deepseek_v3", 3, dict(first_k_dense_replace=1),
                    dict(tp=1, pp=2, dp=1), [[0, 1], [1, 2]]),
    "qwen2_moe_odd": ("qwen2_moe", 5, dict(decoder_sparse_step=2),
                      dict(tp=1, pp=2, dp=1, recompute="full"), [[0, 1], [1, 2]]),
    "qwen2_moe_dense_first": ("qwen2_moe", 4, dict(mlp_only_layers=[0]),
                              dict(tp=2, pp=1, dp=1, sequence_parallel=True), [[0, 3]]),
}
SEQ, BATCH = 16, 8


def _model(case: str):
    """The zoo's tiny model of :data:`CASES`' ``case`` (benchmarks/hf_families.py with its
    every-layer-MoE switches overridden; a rank builds its own)."""
    hf = load_script("benchmarks/hf_families.py")
    from benchmarks.model_zoo import TINY

    model_type, layers, switches, _, _ = CASES[case]
    hf.MOE_EVERY_LAYER = {**hf.MOE_EVERY_LAYER, **switches}
    return hf, hf.build_family(model_type, d={**TINY, "layers": layers})


def _verify_rank(rank: int, world: int, case: str, plan) -> dict:
    from autopar.verify.check import verify

    return verify(_model(case)[1], plan).to_dict()


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_layers_verify(case):
    pytest.importorskip("transformers")
    import autopar
    from autopar.runtime.launch import launch

    hf, model = _model(case)
    plan = autopar.plan(model, hf.tiny_cluster(2), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(**CASES[case][3]), model_name=case)
    assert plan.stage_layers == CASES[case][4]  # groups, one chunk per pipeline stage
    report = launch(_verify_rank, 2, case, plan, timeout_s=300, pg_timeout_s=60)[0]
    assert report["ok"] and report["max_grad_diff"] < 1e-5, report
