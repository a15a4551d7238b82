"""Plans autopar emits, through each framework's own START-UP code on CPU.

tests/framework_startup.py runs torchtitan's ``Trainer.__init__`` model path, megatron-core's
``initialize_model_parallel`` and configs, and DeepSpeed's ``deepspeed.initialize`` on a fake
process group of the plan's world size; here small hand-built plans inside each target's
space are emitted and started, with asserts on what the framework built, and for each
framework a deliberately wrong configuration per check is refused by the framework's code.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import autopar
from autopar.frameworks import emit, outside_target, target_support
from autopar.contract.plan import Plan
from autopar.contract.stages import even_stage_layers
from autopar.techniques.pipeline_schedules import pipeline_schedule
import framework_startup as fs
from helpers import TINY_BATCH, TINY_SEQ, tiny_meta_gpt

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def base_plan() -> Plan:
    """A real plan whose layout fields the plans below replace (as test_frameworks.py's)."""
    return autopar.plan(tiny_meta_gpt(), autopar.Cluster.local_cpu(processes=2),
                        global_batch_size=TINY_BATCH, seq_len=TINY_SEQ, model_name="gpt-tiny")


def _llama(layers: int, kv_heads: int = 2) -> dict:
    """A tiny Llama (Hugging Face config fields): h = 128, 8 heads, FFN 344, V = 512."""
    return {"num_hidden_layers": layers, "hidden_size": 128, "num_attention_heads": 8,
            "num_key_value_heads": kv_heads, "intermediate_size": 344, "vocab_size": 512,
            "max_position_embeddings": 256, "hidden_act": "silu", "tie_word_embeddings": False,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


def _gpt(layers: int) -> dict:
    """A tiny GPT (autopar's GPTConfig fields): h = 128, 4 heads, V = 512."""
    return {"n_layer": layers, "n_head": 4, "n_embd": 128, "vocab_size": 512, "block_size": 256,
            "dropout": 0.0}


def _plan(base: Plan, target: str, config: dict, *, tp=1, pp=1, dp=1, mbs=1, m=1, zero=0,
          schedule="1f1b", v=1, recompute="none", stages=None, dtype="bf16",
          grad_dtype=None, check=True, cp=1) -> Plan:
    """``base`` with this layout (B = dp·mbs·m, s = 64), checked inside ``target``'s space
    unless not ``check``."""
    layers = config.get("num_hidden_layers") or config["n_layer"]
    plan = dataclasses.replace(
        base, model="tiny", model_config=config, tp=tp, pp=pp, dp=dp, cp=cp, micro_batch_size=mbs,
        num_micro_batches=m, global_batch_size=dp * mbs * m, seq_len=64, schedule=schedule,
        virtual_stages=v, zero_stage=zero,
        recompute=recompute if isinstance(recompute, list) else [recompute] * layers,
        stage_layers=stages or even_stage_layers(layers, pp, v), sequence_parallel=tp > 1,
        dtype=dtype, grad_dtype=grad_dtype or ("fp32" if dtype == "fp32" else "bf16"))
    kernel = target_support(target).attention_for(base.cluster["attention"], dtype)
    plan = dataclasses.replace(plan, attention=None if kernel == base.cluster["attention"]
                               else kernel)
    problem = outside_target(plan, target) if check else None
    assert problem is None, problem
    return plan


# ------------------------------------------------------------------------------ torchtitan
TORCHTITAN = {  # name -> layout; every world size 2-8
    "fsdp-ac": dict(dp=4, mbs=2, m=2, zero=3, recompute="full", grad_dtype="fp32"),
    "fsdp-tp": dict(tp=2, dp=2, mbs=2, m=2, zero=3, grad_dtype="fp32"),
    "ddp": dict(dp=2, mbs=2, m=2, zero=0, grad_dtype="fp32"),
    "tp-1f1b-uneven": dict(tp=2, pp=2, mbs=1, m=4, stages=[[0, 1], [1, 4]], dtype="fp32"),
    "interleaved": dict(pp=2, m=4, schedule="interleaved_1f1b", v=2, dtype="fp32",
                        recompute="full"),
    "gpipe-tp4": dict(tp=4, pp=2, mbs=2, m=2, schedule="gpipe", dtype="fp32"),
    "zb-v": dict(pp=2, m=4, schedule="zb_v", v=2, dtype="fp32"),
    "dualpipe-v": dict(pp=2, m=4, schedule="dualpipe_v", v=2, dtype="fp32"),
}


def _torchtitan_plan(base: Plan, layers: int = 4, kv_heads: int = 4, **layout) -> Plan:
    return _plan(base, "torchtitan", _llama(layers, kv_heads), **layout)


def _torchtitan_start(plan: Plan, rank: int = 0, **kwargs):
    from autopar.frameworks.torchtitan import torchtitan_model_args

    return fs.torchtitan_startup(emit(plan, "torchtitan"), torchtitan_model_args(plan)[1],
                                 plan.num_gpus, rank=rank, **kwargs)


@pytest.mark.parametrize("name", list(TORCHTITAN))
def test_torchtitan_starts_the_plan(base_plan, name):
    """Mesh of the plan's degrees; FSDP on every TransformerBlock at ZeRO-3 with bf16 params
    reduced in fp32, DDP at ZeRO-0; TP on the attention and MLP weights; activation
    checkpointing as planned; the precision torchtitan trains in is the plan's; each
    pipeline rank builds the plan's chunks (chunk c on rank c % pp, or ZB-V's V: rank r
    holds chunks r and 2pp - 1 - r) in the plan's schedule (the torch class its record
    names); without pipelining the first forward runs too."""
    pytest.importorskip("torchtitan")
    layout = dict(TORCHTITAN[name])
    layers = 8 if layout.get("v", 1) > 1 else 4
    plan = _torchtitan_plan(base_plan, layers, **layout)
    p = plan.pp
    chunks = {}
    for pp_rank in range(p):  # pp is the outermost mesh dimension: rank r·N/p is on pp rank r
        run = _torchtitan_start(plan, rank=pp_rank * plan.num_gpus // p, forward=p == 1)
        dims = run.parallel_dims
        assert (dims.world_size, dims.tp, dims.pp, dims.dp_replicate * dims.dp_shard) == (
            plan.num_gpus, plan.tp, p, plan.dp)
        assert run.data_parallel == (None if plan.dp == 1 else
                                     "fsdp" if plan.zero_stage == 3 else "ddp")
        blocks = [b for part in run.model_parts for b in part.layers.values()]
        if run.data_parallel == "fsdp":
            assert all("fully_shard" in fs._composable(block) for block in blocks)
            assert run.mp_policy.param_dtype == DTYPES[plan.dtype]
            assert run.mp_policy.reduce_dtype == torch.float32  # plan.grad_dtype
        # the precision torchtitan trains in: FSDP's param dtype, else autocast's, else fp32
        trained = (run.mp_policy.param_dtype if run.mp_policy else
                   run.autocast_dtype or torch.float32)
        assert trained == DTYPES[plan.dtype]
        for block in blocks:
            assert ("CheckpointWrapper" in type(block).__name__) == (plan.recompute[0] == "full")
            weight = block.attention.wq.weight
            if plan.tp > 1:
                tp_dim = weight.device_mesh.mesh_dim_names.index("tp")
                assert weight.placements[tp_dim] == torch.distributed.tensor.Shard(0)
                assert block.feed_forward.w2.weight.placements[tp_dim] == \
                    torch.distributed.tensor.Shard(1)
            elif plan.dp == 1 or plan.zero_stage == 0:
                assert not isinstance(weight, torch.distributed.tensor.DTensor)
        if p == 1:
            assert run.gradient_accumulation_steps == plan.num_micro_batches
            assert run.logits_shape == (plan.micro_batch_size, plan.seq_len, 512)
        else:  # local batch = b·m, one accumulation step, m micro-batches in the schedule
            assert run.gradient_accumulation_steps == 1
            record = pipeline_schedule(plan.schedule)
            assert type(run.schedule).__name__ == record.runner
            assert run.schedule._n_microbatches == plan.num_micro_batches
            assert run.stage_indices == record.rank_chunks(p, p * plan.virtual_stages, pp_rank)
            for index, part in zip(run.stage_indices, run.model_parts):
                chunks[index] = ([int(i) for i in part.layers],
                                 part.tok_embeddings is not None, part.output is not None)
    if p > 1:
        last = len(plan.stage_layers) - 1
        assert chunks == {c: (list(range(lo, hi)), c == 0, c == last)
                          for c, (lo, hi) in enumerate(plan.stage_layers)}


def test_torchtitan_plan_with_more_tp_ranks_than_kv_heads_is_refused(base_plan):
    """tp = 4 over 2 KV heads: torchtitan starts such a run but its first forward fails (the
    K/V projections split below one head per rank), so autopar refuses it before emitting,
    and a 2-way split of the same model runs its first forward."""
    pytest.importorskip("torchtitan")
    from autopar.frameworks.torchtitan import torchtitan_model_args

    plan = _plan(base_plan, "torchtitan", _llama(2, kv_heads=2), tp=4, dp=2, mbs=2, m=1,
                 zero=3, grad_dtype="fp32", check=False)
    with pytest.raises(ValueError, match="2 do not divide over tp=4"):
        emit(plan, "torchtitan")
    plan = _plan(base_plan, "torchtitan", _llama(2, kv_heads=2), tp=2, dp=4, mbs=2, m=1,
                 zero=3, grad_dtype="fp32")
    run = fs.torchtitan_startup(emit(plan, "torchtitan"), torchtitan_model_args(plan)[1],
                                plan.num_gpus, forward=True)
    assert run.logits_shape == (2, plan.seq_len, 512)


def _edit_toml(text: str, **values) -> str:
    for key, value in values.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.MULTILINE)
        assert n == 1, key
    return text


@pytest.mark.parametrize("case, error, match", [
    ("world size", AssertionError, "Invalid parallel dims"),
    ("DDP with TP", RuntimeError, "DDP has not supported > 1D parallelism"),
    ("seq_len", AssertionError, "must be divisible by the product of TP degree"),
    ("global batch", AssertionError, "global batch size must be multiple of local batch"),
    ("pipeline micro-batch", ValueError, "must be divisible by microbatch_size"),
])
def test_torchtitan_startup_refuses_a_wrong_configuration(base_plan, case, error, match):
    """Each check of torchtitan's start-up fails on a configuration made wrong for it:
    ParallelDims (degrees vs world size), parallelize_llama (DDP beside TP, seq_len vs TP),
    train.py's batch check, build_pipeline_schedule (local batch vs micro-batch)."""
    pytest.importorskip("torchtitan")
    from autopar.frameworks.torchtitan import torchtitan_model_args

    layout = TORCHTITAN["tp-1f1b-uneven" if case == "pipeline micro-batch" else "fsdp-tp"]
    plan = _torchtitan_plan(base_plan, **layout)
    world = plan.num_gpus
    text, args = emit(plan, "torchtitan"), torchtitan_model_args(plan)[1]
    fs.torchtitan_startup(text, args, world)  # as emitted: runs
    if case == "world size":
        world *= 2
    elif case == "DDP with TP":
        text = _edit_toml(text, data_parallel_replicate_degree=2, data_parallel_shard_degree=1)
    elif case == "seq_len":
        text = _edit_toml(text, seq_len=66)
    elif case == "global batch":
        text = _edit_toml(text, global_batch_size=6)
    else:
        text = _edit_toml(text, pipeline_parallel_microbatch_size=3)
    with pytest.raises(error, match=match):
        fs.torchtitan_startup(text, args, world)


# -------------------------------------------------------------------------------- Megatron
MEGATRON = {  # name -> (model, layout); world sizes 4-16
    "tp-pp-distopt": (_gpt(4), dict(tp=2, pp=2, dp=2, mbs=1, m=4, zero=1, recompute="selective",
                                    grad_dtype="fp32")),
    "interleaved-bf16-grads": (_gpt(8), dict(pp=4, dp=2, mbs=1, m=4, v=2,
                                             schedule="interleaved_1f1b", recompute="full")),
    "tp4-fp32": (_gpt(4), dict(tp=4, dp=4, mbs=2, m=1, zero=1, dtype="fp32")),
    "llama-gqa-uneven-block": (_llama(6), dict(
        tp=2, pp=2, mbs=1, m=2, stages=[[0, 2], [2, 6]], grad_dtype="fp32",
        recompute=["full", "none", "full", "none", "none", "none"])),
    "llama-cp2-tp2": (_llama(4), dict(tp=2, cp=2, dp=2, mbs=1, m=2, zero=1,
                                      recompute="selective")),
}


@pytest.mark.parametrize("name", list(MEGATRON))
def test_megatron_starts_the_plan(base_plan, name):
    """parallel_state's data-parallel size is the plan's d; TransformerConfig has the plan's
    tp, pp, v, sequence parallelism, cp (all-gather CP) and layers per (pipeline rank,
    virtual stage); the DDP
    config reduces in fp32 exactly when the plan has fp32 gradients under bf16 and shards
    the optimizer at ZeRO-1; megatron-core's micro-batch count is the plan's m."""
    pytest.importorskip("megatron.core")
    import framework_configs as fc

    config, layout = MEGATRON[name]
    plan = _plan(base_plan, "megatron", config, **layout)
    dp, tc, ddp, *_ = fs.megatron_startup(fs.megatron_argv(emit(plan, "megatron")), plan.num_gpus)
    assert dp == plan.dp
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size,
            tc.virtual_pipeline_model_parallel_size or 1, tc.sequence_parallel,
            tc.context_parallel_size) == (
        plan.tp, plan.pp, plan.virtual_stages, plan.sequence_parallel, plan.cp)
    assert plan.cp == 1 or tc.cp_comm_type == "all_gather"  # the CP autopar prices
    assert tc.params_dtype == DTYPES[plan.dtype]
    assert fc.megatron_stage_layers(tc) == [[hi - lo for lo, hi in plan.stage_layers[r::plan.pp]]
                                           for r in range(plan.pp)]
    assert ddp.grad_reduce_in_fp32 == (plan.dtype == "bf16" and plan.grad_dtype == "fp32")
    assert ddp.use_distributed_optimizer == (plan.zero_stage == 1)
    assert fc.megatron_microbatches(plan.global_batch_size, plan.micro_batch_size, dp) == \
        plan.num_micro_batches


def test_megatron_starts_a_searched_plan():
    """A plan autopar searched for Megatron (4-layer GPT, 4 local ranks, tp = 2 pinned)."""
    pytest.importorskip("megatron.core")
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=64))
    plan = autopar.plan(model, autopar.Cluster.local_cpu(processes=4), global_batch_size=16,
                        seq_len=64, model_name="gpt-small", target="megatron",
                        layout=autopar.Layout(tp=2))
    dp, tc, ddp, *_ = fs.megatron_startup(fs.megatron_argv(emit(plan, "megatron")), plan.num_gpus)
    assert (dp, tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size) == (
        plan.dp, 2, plan.pp)
    assert ddp.use_distributed_optimizer == (plan.zero_stage == 1)


@pytest.mark.parametrize("case, error, match", [
    ("world size", RuntimeError, r"world_size \(10\) is not divisible by 4"),
    ("global batch", AssertionError, "global batch size"),
    ("heads over tp", ValueError, "num_attention_heads"),
])
def test_megatron_startup_refuses_a_wrong_configuration(base_plan, case, error, match):
    """initialize_model_parallel refuses a world size tp·pp does not divide, the micro-batch
    calculator a global batch that is not b·d·k, TransformerConfig heads tp does not divide."""
    pytest.importorskip("megatron.core")
    config, layout = MEGATRON["tp-pp-distopt"]
    plan = _plan(base_plan, "megatron", config, **layout)
    argv, world = fs.megatron_argv(emit(plan, "megatron")), plan.num_gpus
    fs.megatron_startup(argv, world)  # as emitted: runs
    if case == "world size":
        world = 10
    elif case == "global batch":
        argv[argv.index("--global-batch-size") + 1] = "7"
    else:
        argv[argv.index("--num-attention-heads") + 1] = "3"
        argv[argv.index("--hidden-size") + 1] = "129"
    with pytest.raises(error, match=match):
        fs.megatron_startup(argv, world)


# ------------------------------------------------------------------------------- DeepSpeed
DEEPSPEED = {  # name -> layout; world sizes 2-8
    "zero0-bf16": dict(dp=4, mbs=2, m=2, zero=0, recompute="full"),
    "zero2-bf16": dict(dp=8, mbs=1, m=2, zero=2),
    "zero3-fp32": dict(dp=2, mbs=2, m=2, zero=3, dtype="fp32"),
    "pipe-zero1-bf16": dict(pp=2, dp=2, mbs=1, m=4, zero=1, recompute="full"),
    "pipe4-fp32": dict(pp=4, dp=2, mbs=2, m=4, zero=1, dtype="fp32"),
}
_DS_OPTIMIZER = {(0, "bf16"): "FP16_UnfusedOptimizer",  # DDP_BFLOAT16, non-fused client Adam
                 (0, "fp32"): "AdamW", (1, "bf16"): "DeepSpeedZeroOptimizer",
                 (1, "fp32"): "DeepSpeedZeroOptimizer", (2, "bf16"): "DeepSpeedZeroOptimizer",
                 (3, "fp32"): "DeepSpeedZeroOptimizer_Stage3"}


@pytest.mark.parametrize("name", list(DEEPSPEED))
def test_deepspeed_starts_the_plan(base_plan, name):
    """deepspeed.initialize builds the engine with the plan's d, batch, accumulation and ZeRO
    stage (its optimizer wrapper accordingly), gradients accumulated and reduced in the
    plan's dtype; with pipelining a PipelineEngine whose PipelineModule puts the plan's
    layers on each stage and checkpoints every layer when the plan recomputes."""
    pytest.importorskip("deepspeed")
    layout = DEEPSPEED[name]
    layers = 8 if layout.get("pp", 1) > 2 else 4
    plan = _plan(base_plan, "deepspeed", _gpt(layers), **layout)
    run = fs.deepspeed_startup(json.loads(emit(plan, "deepspeed")), plan.num_gpus, plan.pp,
                               num_layers=layers)
    assert (run.dp_world_size, run.zero_stage) == (plan.dp, plan.zero_stage)
    assert (run.config.train_batch_size, run.config.train_micro_batch_size_per_gpu,
            run.config.gradient_accumulation_steps) == (
        plan.global_batch_size, plan.micro_batch_size, plan.num_micro_batches)
    assert run.optimizer == _DS_OPTIMIZER[plan.zero_stage, plan.dtype]
    assert run.communication_dtype == run.grad_accum_dtype == DTYPES[plan.dtype]
    if plan.zero_stage == 2:
        assert run.engine.optimizer.partition_gradients
    if plan.pp > 1:
        assert type(run.engine).__name__ == "PipelineEngine"
        assert run.engine.num_stages == plan.pp and run.engine.micro_batches == plan.num_micro_batches
        assert run.stage_blocks == [hi - lo for lo, hi in plan.stage_layers]
        assert run.activation_checkpoint_interval == int("full" in plan.recompute)
    else:
        assert type(run.engine).__name__ == "DeepSpeedEngine"


def test_deepspeed_starts_a_searched_plan():
    """A plan autopar searched for DeepSpeed (4-layer GPT, 4 local ranks)."""
    pytest.importorskip("deepspeed")
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=64))
    plan = autopar.plan(model, autopar.Cluster.local_cpu(processes=4), global_batch_size=16,
                        seq_len=64, model_name="gpt-small", target="deepspeed")
    run = fs.deepspeed_startup(json.loads(emit(plan, "deepspeed")), plan.num_gpus, plan.pp,
                               num_layers=4)
    assert (run.dp_world_size, run.zero_stage, run.config.train_batch_size) == (
        plan.dp, plan.zero_stage, plan.global_batch_size)


@pytest.mark.parametrize("case, error, match", [
    ("ZeRO-2 with a pipeline", AssertionError, "ZeRO-2 and ZeRO-3 are incompatible with pipeline"),
    ("batch", AssertionError, "Check batch related parameters"),
    ("stages vs world", RuntimeError, r"num_stages \(3\) must divide distributed world size"),
    ("fp32 accumulation at ZeRO-0", NotImplementedError, "unsupported mix"),
])
def test_deepspeed_startup_refuses_a_wrong_configuration(base_plan, case, error, match):
    """PipelineEngine refuses ZeRO-2 with a pipeline; DeepSpeedConfig a train_batch_size that
    is not b·m·d; PipelineModule a stage count that does not divide the world; the engine's
    optimizer check bf16 with fp32 gradient accumulation at ZeRO-0."""
    pytest.importorskip("deepspeed")
    plan = _plan(base_plan, "deepspeed", _gpt(4), **DEEPSPEED["pipe-zero1-bf16"])
    config, world, p = json.loads(emit(plan, "deepspeed")), plan.num_gpus, plan.pp
    fs.deepspeed_startup(config, world, p)  # as emitted: runs
    if case == "ZeRO-2 with a pipeline":
        config["zero_optimization"]["stage"] = 2
    elif case == "batch":
        config["train_batch_size"] += 2
    elif case == "stages vs world":
        p = 3
    else:
        config = json.loads(emit(_plan(base_plan, "deepspeed", _gpt(4),
                                       **DEEPSPEED["zero0-bf16"]), "deepspeed"))
        world, p = 4, 1
        config["data_types"]["grad_accum_dtype"] = "fp32"
    with pytest.raises(error, match=match):
        fs.deepspeed_startup(config, world, p)


# ----------------------------------------------------- random plans of each target's space
def _started_as_planned(plan: Plan, target: str) -> None:
    """``emit(plan, target)`` through the framework's start-up, and what it built is the
    plan's: degrees, data-parallel size and sharding, precision, stages."""
    from autopar.frameworks.torchtitan import torchtitan_model_args
    from autopar.contract.support import plan_grad_dtype

    text = emit(plan, target)
    bf16 = plan.dtype == "bf16"
    if target == "megatron":
        run = fs.megatron_startup(fs.megatron_argv(text), plan.num_gpus)
        config = run.transformer_config
        assert run.data_parallel_size == plan.dp
        assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (
            plan.tp, plan.pp)
        assert run.ddp_config.grad_reduce_in_fp32 == (bf16 and plan_grad_dtype(plan) == "fp32")
        assert run.ddp_config.use_distributed_optimizer == (plan.zero_stage == 1)
    elif target == "torchtitan":
        run = fs.torchtitan_startup(text, torchtitan_model_args(plan)[1], plan.num_gpus)
        dims = run.parallel_dims
        assert (dims.tp, dims.pp, dims.dp_replicate * dims.dp_shard) == (plan.tp, plan.pp,
                                                                          plan.dp)
        fsdp = plan.zero_stage == 3 and plan.dp > 1
        assert run.data_parallel == ("fsdp" if fsdp else "ddp" if plan.dp > 1 else None)
        if fsdp:  # bf16 weights in compute, gradients reduced in fp32: what autopar priced
            assert run.mp_policy.reduce_dtype == torch.float32
            assert run.mp_policy.param_dtype == DTYPES[plan.dtype]
        trains_bf16 = fsdp and run.mp_policy.param_dtype == torch.bfloat16 or (
            run.autocast_dtype == torch.bfloat16)
        assert trains_bf16 == bf16
    else:
        run = fs.deepspeed_startup(json.loads(text), plan.num_gpus, plan.pp,
                                   num_layers=len(plan.recompute))
        assert (run.dp_world_size, run.zero_stage) == (plan.dp, plan.zero_stage)
        if bf16:
            assert run.communication_dtype == run.grad_accum_dtype == torch.bfloat16
        if plan.pp > 1:
            assert run.stage_blocks == [hi - lo for lo, hi in plan.stage_layers]


@pytest.mark.parametrize("target", ["megatron", "torchtitan", "deepspeed"])
def test_random_plans_of_each_target_start_in_its_framework(base_plan, target):
    """40 random plans inside each target's space (test_frameworks.target_plans: up to 64
    ranks, models small enough to build), emitted and started by the framework's own
    start-up code on a fake process group of the plan's world size."""
    from hypothesis import HealthCheck, given, settings

    from test_frameworks import target_plans

    started = []

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(target_plans(base_plan, target, max_world=64, tiny=True))
    def check(plan):
        assert outside_target(plan, target) is None
        _started_as_planned(plan, target)
        started.append(plan)

    check()
    assert len(started) == 40
    print(f"{target}: {len(started)} random plans started, world sizes "
          f"{sorted({p.num_gpus for p in started})}")


def test_example_report_plans_start_in_the_frameworks():
    """Every example report's plan (reports/*/plan*.json: up to 3072 ranks) that a framework
    runs, started by that framework (the GPT examples are no torchtitan model: refused)."""
    from pathlib import Path

    from autopar.frameworks import model_problem

    started = 0
    for path in sorted((Path(__file__).resolve().parents[2] / "reports").glob("*/plan*.json")):
        plan = Plan.from_json(path.read_text(), str(path))
        for target in ("megatron", "torchtitan", "deepspeed"):
            if model_problem(plan.model_config, target) is None and \
                    outside_target(plan, target) is None:
                _started_as_planned(plan, target)
                started += 1
    assert started >= 7, started
