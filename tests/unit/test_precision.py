"""The gradient precision each target runs, priced: bytes per parameter and reduction dtype.

Megatron-LM under ``--bf16`` keeps fp32 ``main_grad`` buffers and reduces them in fp32 unless
``--grad-reduce-in-bf16`` (arguments.py, core_v0.16.1, validate_args L711-723), torchtitan
0.2.2 reduces in fp32 (``job_config.py``: ``mixed_precision_reduce: Literal["float32"]``)
and trains fp32 with TP or PP and no FSDP (``distributed/utils.py: maybe_enable_amp``),
DeepSpeed 0.19.8 under bf16 accumulates and reduces bf16 gradients by default
(``engine.py`` ``communication_data_type``; ZeRO-1 ``stage_1_and_2.py``). Each target's
plan must be priced in the precision its framework runs, and emitted so that it runs it.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.frameworks import emit, read
from autopar.frameworks.model_shape import build_model
from autopar.planner.costs.tables import bytes_per_param, state_bytes

D = 8


@pytest.mark.parametrize("zero, grads, expected", [
    (0, "bf16", 16), (1, "bf16", 4 + 12 / D), (2, "bf16", 2 + 14 / D), (3, "bf16", 16 / D),
    # Megatron-LM's distributed-optimizer table (docs: bf16 params, fp32 grads: 6 + 12/d)
    (0, "fp32", 18), (1, "fp32", 6 + 12 / D), (2, "fp32", 2 + 16 / D),
    # FSDP2 with reduce_dtype fp32: the fp32 shard is the master copy
    (3, "fp32", 16 / D),
])
def test_bytes_per_parameter_of_each_gradient_precision(zero, grads, expected):
    assert bytes_per_param(zero, D, "bf16", grads) == pytest.approx(expected, rel=1e-12)


def test_reduction_and_gather_bytes_follow_the_gradient_and_compute_dtypes():
    assert (state_bytes("bf16").gather, state_bytes("bf16").reduce) == (2, 2)
    assert (state_bytes("bf16", "fp32", 1).gather, state_bytes("bf16", "fp32", 1).reduce) == (2, 4)
    assert (state_bytes("bf16", "fp32", 3).gather, state_bytes("bf16", "fp32", 3).reduce) == (2, 4)
    assert state_bytes("fp32") == state_bytes("fp32", "fp32", 3)
    with pytest.raises(ValueError, match="fp32 training keeps fp32 gradients"):
        autopar.Layout(dtype="fp32", grad_dtype="bf16")


def _gpt_problem():
    import torch
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=64))
    return model, autopar.Cluster.local_cpu(processes=4)


@pytest.mark.parametrize("zero", [0, 1])
def test_fp32_gradients_cost_their_bytes(zero):
    """The same layout with fp32 gradients: 2 more bytes of gradient per parameter on
    every rank and twice the data-parallel reduction bytes."""
    model, cluster = _gpt_problem()
    layout = dict(tp=1, pp=1, dp=4, micro_batch_size=2, zero_stage=zero, recompute="none",
                  dtype="bf16")
    runs = {g: autopar.evaluate(model, cluster, autopar.Layout(**layout, grad_dtype=g),
                                global_batch_size=16, seq_len=64) for g in ("bf16", "fp32")}
    assert runs["bf16"].grad_dtype == "bf16" and runs["fp32"].grad_dtype == "fp32"
    stats = {g: plan.predicted.stage_stats[0] for g, plan in runs.items()}
    params = sum(p.numel() for p in model.parameters())
    extra = stats["fp32"]["model_state_bytes"] - stats["bf16"]["model_state_bytes"]
    assert extra == pytest.approx(2 * params, rel=1e-9)
    kind = "dp_all_reduce" if zero == 0 else "dp_reduce_scatter"
    assert stats["fp32"]["comm_bytes"][kind] == pytest.approx(
        2 * stats["bf16"]["comm_bytes"][kind], rel=1e-9)
    assert stats["bf16"]["comm_bytes"][kind] > 0
    assert runs["fp32"].predicted.step_time_s > runs["bf16"].predicted.step_time_s


def test_megatron_plans_bf16_gradients_and_emits_the_flag_that_runs_them():
    model, cluster = _gpt_problem()
    plan = autopar.plan(model, cluster, global_batch_size=16, seq_len=64, target="megatron",
                        layout=autopar.Layout(dtype="bf16", dp=4))
    assert plan.grad_dtype == "bf16"
    text = emit(plan, "megatron")
    assert "--bf16" in text and "--grad-reduce-in-bf16" in text
    assert read(text, "megatron", plan.num_gpus).layout.grad_dtype == "bf16"
    # the same script without the flag is what Megatron-LM runs by default: fp32 main grads
    default = text.replace("--grad-reduce-in-bf16", "")
    assert read(default, "megatron", plan.num_gpus).layout.grad_dtype == "fp32"


def _llama_problem():
    shape = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "ffn_hidden_size": 172, "num_query_groups": 2, "seq_length": 64,
             "vocab_size": 256, "swiglu": True, "untied": True}
    model, _ = build_model(shape)
    return model, autopar.Cluster.local_cpu(processes=4)


def test_torchtitan_plans_fp32_reductions_and_fsdp_for_bf16_with_tp():
    """torchtitan: gradients reduced in fp32 always; bf16 with TP only under FSDP (dp > 1),
    plain DDP only without TP and PP, no data parallelism under pipelining."""
    model, cluster = _llama_problem()
    plan = autopar.plan(model, cluster, global_batch_size=16, seq_len=64, target="torchtitan",
                        layout=autopar.Layout(tp=2, dtype="bf16"))
    assert (plan.grad_dtype, plan.dp, plan.zero_stage, plan.dtype) == ("fp32", 2, 3, "bf16")
    text = emit(plan, "torchtitan")
    assert 'mixed_precision_reduce = "float32"' in text
    assert "data_parallel_shard_degree = 2" in text and "data_parallel_replicate_degree = 1" in text
    with pytest.raises(ValueError, match="no ZeRO stage|plain DP only"):
        autopar.plan(model, cluster, global_batch_size=16, seq_len=64, target="torchtitan",
                     layout=autopar.Layout(tp=1, pp=2, dp=2))
    fp32 = autopar.plan(model, cluster, global_batch_size=16, seq_len=64, target="torchtitan",
                        layout=autopar.Layout(tp=2, pp=2))  # no dp to shard: torchtitan runs fp32
    assert (fp32.dtype, fp32.grad_dtype) == ("fp32", "fp32")
    with pytest.raises(ValueError, match="DDP has not supported"):
        read(text.replace("data_parallel_shard_degree = 2", "data_parallel_shard_degree = 1")
             .replace("data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2"),
             "torchtitan")


def test_deepspeed_writes_out_its_bf16_defaults_and_refuses_what_is_not_priced():
    model, cluster = _gpt_problem()
    plan = autopar.plan(model, cluster, global_batch_size=16, seq_len=64, target="deepspeed",
                        layout=autopar.Layout(dtype="bf16", dp=2, pp=2))
    assert plan.grad_dtype == "bf16" and plan.zero_stage == 1  # ZeRO-0 under a pipeline: no
    config = json.loads(emit(plan, "deepspeed"))
    assert config["data_types"] == {"grad_accum_dtype": "bf16"}
    assert config["communication_data_type"] == "bf16"
    for change, match in [({"communication_data_type": "fp32"}, "communication_data_type"),
                          ({"data_types": {"grad_accum_dtype": "fp32"}}, "grad_accum_dtype"),
                          ({"zero_optimization": {"stage": 0}}, "BF16_Optimizer")]:
        with pytest.raises(ValueError, match=match):
            read(json.dumps({**config, **change}), "deepspeed")


def test_deepspeed_without_pipeline_states_the_recompute_the_model_code_runs():
    model, cluster = _gpt_problem()
    plan = autopar.plan(model, cluster, global_batch_size=16, seq_len=64, target="deepspeed",
                        layout=autopar.Layout(pp=1, dp=4, recompute="full"))
    config = json.loads(emit(plan, "deepspeed"))
    assert "pipeline" not in config  # read by the pipeline engine only
    assert config["autopar"]["recompute"] == "full"
    assert any("deepspeed.checkpointing.checkpoint" in line
               for line in config["autopar"]["model_side"])
    assert read(json.dumps(config), "deepspeed").layout.recompute == "full"
    del config["autopar"]
    assert read(json.dumps(config), "deepspeed").layout.recompute == "none"
