"""The attention kernel each target runs, priced and emitted (issue 31).

The cost model prices two kernels (``Cluster.attention``): "math" keeps the softmax and runs
every score; "flash" keeps output and log-sum-exp, computes only the causal tiles on and
below the diagonal and recomputes Q·Kᵀ in backward. A target that fixes its kernel
(torchtitan: flash in bf16, math in fp32; Megatron-LM: math in fp32) is planned with it
whatever the cluster says; Megatron-LM's ``--attention-backend`` is emitted to match and
read back as Megatron-LM runs it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autopar
from autopar.frameworks import emit, outside_target, price_run, read, read_megatron_args, target_support
from autopar.graph.capture import trace_model
from autopar.planner.costs.matmul_cost import CAUSAL_SKIP_FRACTION, gemm_times_s
from autopar.planner.strategies import node_strategies
from cost_models import compute
from helpers import TINY_BATCH, TINY_SEQ, tiny_meta_gpt

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def a100_plans():
    """The tiny GPT planned on one DGX A100 node (the preset prices "math") for the autopar
    runtime, Megatron-LM and torchtitan."""
    cluster = autopar.Cluster.dgx_a100(nodes=1)
    assert cluster.attention == "math"
    return cluster, {target: autopar.plan(tiny_meta_gpt(), cluster, global_batch_size=TINY_BATCH,
                                          seq_len=TINY_SEQ, model_name="gpt-tiny", target=target)
                     for target in ("autopar", "megatron", "torchtitan")}


@pytest.mark.parametrize("target, cluster_kernel, dtype, kernel", [
    ("autopar", "math", "bf16", "math"), ("autopar", "flash", "fp32", "flash"),
    ("deepspeed", "math", "bf16", "math"), ("deepspeed", "flash", "bf16", "flash"),
    ("megatron", "math", "bf16", "math"), ("megatron", "flash", "bf16", "flash"),
    ("megatron", "flash", "fp32", "math"),  # TE's fused kernels take 16-bit inputs only
    ("torchtitan", "math", "bf16", "flash"),  # SDPA: cuDNN, then flash, then math
    ("torchtitan", "flash", "fp32", "math"),
])
def test_each_target_runs_its_kernel(target, cluster_kernel, dtype, kernel):
    assert target_support(target).attention_for(cluster_kernel, dtype) == kernel


def test_plans_are_priced_with_the_kernel_their_target_runs(a100_plans):
    """On a "math" cluster the autopar and Megatron-LM plans keep the cluster's kernel
    (Megatron-LM is told so: ``--attention-backend unfused``); torchtitan's bf16 plan is
    priced with flash, recorded on the plan, and re-priced the same from it."""
    cluster, plans = a100_plans
    assert plans["autopar"].attention is None and plans["autopar"].attention_kernel == "math"
    megatron = plans["megatron"]
    assert megatron.attention_kernel == "math"
    assert "--attention-backend unfused" in emit(megatron, "megatron")
    titan = plans["torchtitan"]
    assert titan.attention_kernel == target_support("torchtitan").attention_for("math", titan.dtype)
    if titan.dtype == "bf16":
        assert titan.attention == "flash"
    again = autopar.evaluate_plan(tiny_meta_gpt(), cluster, titan)
    assert again.predicted == titan.predicted
    assert autopar.Plan.from_json(titan.to_json()) == titan
    # the same layout priced with the cluster's kernel is another prediction
    math = autopar.evaluate_plan(tiny_meta_gpt(), cluster, dataclasses.replace(titan, attention=None))
    if titan.attention == "flash":
        assert math.predicted != titan.predicted


def test_a_plan_priced_with_another_kernel_is_outside_the_target(a100_plans):
    _, plans = a100_plans
    titan = dataclasses.replace(plans["torchtitan"], attention=None)  # the cluster's math
    if titan.dtype == "bf16":
        assert "torchtitan runs flash attention in bf16" in outside_target(titan, "torchtitan")
    flash = dataclasses.replace(plans["autopar"], attention="flash")
    assert "the model's own attention" in outside_target(flash, "deepspeed")
    fp32 = dataclasses.replace(plans["megatron"], dtype="fp32", grad_dtype=None, attention="flash")
    assert "megatron runs math attention in fp32" in outside_target(fp32, "megatron")


def test_emitted_backend_reads_back_to_the_kernel(a100_plans):
    _, plans = a100_plans
    for kernel, backend in (("flash", "flash"), ("math", "unfused")):
        plan = dataclasses.replace(plans["megatron"], dtype="bf16", attention=kernel)
        text = emit(plan, "megatron")
        assert f"--attention-backend {backend}" in text
        assert read(text, "megatron", plan.num_gpus).attention == kernel


@pytest.mark.parametrize("flags, kernel", [
    ("", "flash"),  # default auto: TE picks flash or cuDNN fused attention for bf16
    ("--attention-backend auto", "flash"), ("--attention-backend fused", "flash"),
    ("--attention-backend flash", "flash"), ("--attention-backend unfused", "math"),
    ("--attention-backend local", "math"),
])
def test_megatron_reader_prices_the_backend(flags, kernel):
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --micro-batch-size 1 --bf16 "
    assert read_megatron_args(base + flags, 8).attention == kernel
    if kernel == "math" or flags in ("", "--attention-backend auto"):
        fp32 = read_megatron_args(base.replace("--bf16 ", "") + flags, 8)
        assert fp32.attention == "math"  # TE runs unfused attention for fp32 inputs


@pytest.mark.parametrize("flags, match", [
    ("--attention-backend flash", "16-bit inputs only"),
    ("--attention-backend fused", "16-bit inputs only"),
    ("--attention-backend flashy --bf16", "Megatron-LM knows"),
])
def test_megatron_reader_refuses_a_backend_that_cannot_run(flags, match):
    with pytest.raises(ValueError, match=match):
        read_megatron_args("--num-layers 2 --micro-batch-size 1 " + flags, 8)


def test_megatron_llama3_script_reads_its_fused_backend():
    """Megatron-LM's own Llama 3 8B script sets ``--attention-backend fused`` (cuDNN)."""
    text = (DATA / "megatron_train_llama3_8b_h100_fp8.sh").read_text()
    for flag in ('"--fp8-format hybrid"', '"--fp8-amax-history-len 1024"',
                 '"--fp8-amax-compute-algo max"', '"--fp8-param-gather"'):
        text = text.replace(flag, "")
    assert read_megatron_args(text, 8).attention == "flash"


def test_a_read_run_is_priced_with_its_kernel():
    """The same flags priced with ``unfused`` and ``flash`` on one "math" cluster: the
    flash run keeps less (output and log-sum-exp, not the softmax)."""
    cluster = autopar.Cluster.dgx_a100(nodes=1)
    flags = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "
             "--max-position-embeddings 64 --vocab-size 256 --micro-batch-size 1 "
             "--global-batch-size 8 --bf16 --attention-backend ")
    unfused = price_run(read_megatron_args(flags + "unfused", 8), cluster)
    flash = price_run(read_megatron_args(flags + "flash", 8), cluster)
    assert flash.predicted.peak_memory_bytes < unfused.predicted.peak_memory_bytes


def test_flash_kernel_time_skips_causal_tiles_and_recomputes_the_scores():
    """gemm_times_s of a causal sdpa node: math runs Q·Kᵀ and P·V whole (four backward
    GEMMs); flash adds Q·Kᵀ to backward and halves both (FlashAttention-2's own count)."""
    traced = trace_model(tiny_meta_gpt(), TINY_SEQ, name="gpt-tiny")
    name = next(n for n, i in traced.nodes.items() if i.kind == "sdpa")
    info = traced.nodes[name]
    assert info.extra["causal_skip"] is True  # is_causal=True, no mask
    dev = autopar.Cluster.dgx_h100(nodes=1).device
    strat = node_strategies(traced, 1)[name][0]
    math_f, math_b, math_w = gemm_times_s(info, strat, 2, dev, "math")
    flash_f, flash_b, flash_w = gemm_times_s(info, strat, 2, dev, "flash")
    batch, m, n, k = info.extra["gemms"][0]
    qk = compute.gemm_time_s(m, n, k, dev, batch * 2)
    assert qk > 0 and math_f > 0
    assert flash_f == pytest.approx(CAUSAL_SKIP_FRACTION * math_f)
    assert flash_b == pytest.approx(CAUSAL_SKIP_FRACTION * (math_b + qk))
    assert math_w == flash_w == 0.0  # attention holds no weights: its backward is all B
    masked = dataclasses.replace(info, extra={**info.extra, "causal_skip": False})
    assert gemm_times_s(masked, strat, 2, dev, "flash") == pytest.approx((math_f, math_b + qk, 0.0))


def test_an_explicit_mask_is_not_skipped():
    """A Hugging Face decoder traced with its mask tensor (``attn_mask``, no ``is_causal``)
    runs a fused kernel over every tile: no skip."""
    from autopar.frameworks.model_shape import build_model

    model, name = build_model({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                               "ffn_hidden_size": 128, "num_query_groups": 2, "seq_length": 64,
                               "vocab_size": 128, "swiglu": True, "untied": True})
    traced = trace_model(model, 32, name=name)
    sdpa = [i for i in traced.nodes.values() if i.kind == "sdpa"]
    assert sdpa and not any(i.extra["causal_skip"] for i in sdpa)


def test_plan_json_refuses_an_unknown_kernel(a100_plans):
    _, plans = a100_plans
    data = plans["torchtitan"].to_dict()
    data["attention"] = "sparse"
    with pytest.raises(autopar.PlanError, match="attention"):
        autopar.Plan.from_dict(data)
    assert "attention" not in plans["autopar"].to_dict()  # the cluster's: not written
