"""Expert parallelism in the framework configurations (autopar/frameworks/megatron_moe.py):
a tiny Mixtral planned at ep = 2 is emitted as Megatron-LM flags that megatron-core's own
start-up accepts, with the EP groups autopar prices; Megatron-LM's MoE flags are read back
(Mixtral 8x7B's launch script included); torchtitan and DeepSpeed refuse ep > 1 by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autopar
from autopar.frameworks import emit, outside_target, read_megatron_args, read_torchtitan_toml
from autopar.frameworks.deepspeed import deepspeed_config
from autopar.frameworks.megatron_moe import moe_model_args, moe_model_problem
from autopar.techniques.expert_parallel import expert_ranks
import framework_startup as fs

MIXTRAL_SCRIPT = Path(__file__).parent / "data" / "megatron_train_mixtral_8x7b_distributed.sh"


@pytest.fixture(scope="module")
def ep_plan():
    """Tiny Mixtral (2 layers, h 64, E 4, top-2, F 128) at tp1 pp1 dp4 ep2, bf16, B 8, s 16."""
    pytest.importorskip("transformers")
    from benchmarks.hf_families import build_family

    layout = autopar.Layout.parse("tp=1,pp=1,dp=4,ep=2,mbs=1,zero_stage=0,dtype=bf16")
    return autopar.evaluate(build_family("mixtral"), autopar.Cluster.local_cpu(processes=4),
                            layout, global_batch_size=8, seq_len=16)


def _args(plan) -> list[str]:
    return fs.megatron_argv(emit(plan, "megatron"))


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_emitted_ep_flags(ep_plan):
    """The MoE model flags and the EP flags of the plan (alltoall, expert-TP 1, grouped
    GEMM); the plan is inside the megatron target."""
    assert outside_target(ep_plan, "megatron") is None
    argv = _args(ep_plan)
    assert [_value(argv, f) for f in ("--num-experts", "--moe-router-topk",
                                      "--moe-ffn-hidden-size", "--expert-model-parallel-size",
                                      "--expert-tensor-parallel-size",
                                      "--moe-token-dispatcher-type")] == \
        ["4", "2", "128", "2", "1", "alltoall"]
    assert "--moe-grouped-gemm" in argv and "--moe-layer-freq" not in argv
    assert _value(argv, "--rotary-base") == "1000000"  # Mixtral's rope_theta
    assert "ep=2" in emit(ep_plan, "megatron").splitlines()[0]
    dense = _args(dataclasses.replace(ep_plan, ep=1))
    assert "--num-experts" in dense and "--expert-model-parallel-size" not in dense


def test_emitted_ep_flags_pass_megatron_validate_args(ep_plan):
    """Megatron-LM's validate_args rules (tests/megatron_validate.py, core_v0.16.1) and
    parallel_state's expert mesh check accept the flags on the plan's 4 GPUs."""
    pytest.importorskip("megatron.core")
    import megatron_validate as mv

    args = mv.validate_layout_args(_args(ep_plan), ep_plan.num_gpus, environ={}, device_arch=9)
    assert (args.data_parallel_size, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size, args.num_experts) == (4, 2, 1, 4)


@pytest.mark.parametrize("rank", [0, 3])
def test_megatron_starts_the_ep_plan_with_autopars_groups(ep_plan, rank):
    """megatron-core's initialize_model_parallel and TransformerConfig accept the emitted
    flags on 4 ranks; its EP group and expert-data-parallel group of ``rank`` are the ranks
    autopar prices (techniques.expert_parallel.expert_ranks: ep over consecutive DP ranks)."""
    pytest.importorskip("megatron.core")
    run = fs.megatron_startup(_args(ep_plan), ep_plan.num_gpus, rank=rank)
    tc = run.transformer_config
    assert run.data_parallel_size == 4
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (4, 2, 128)
    assert (tc.expert_model_parallel_size, tc.expert_tensor_parallel_size) == (2, 1)
    assert tc.moe_token_dispatcher_type == "alltoall" and tc.moe_grouped_gemm
    _, ep_group, edp_group = expert_ranks(rank, 4, 2)
    assert (run.expert_group, run.expert_data_group) == (ep_group, edp_group)


@pytest.mark.parametrize("flag, value, error, match", [
    ("--expert-model-parallel-size", "3", AssertionError, "multiple of expert model parallel"),
    ("--expert-model-parallel-size", "8", RuntimeError, "expert_tensor_model_pipeline_parallel"),
])
def test_megatron_startup_refuses_a_wrong_ep_configuration(ep_plan, flag, value, error, match):
    """Megatron-LM refuses E not divisible by ep (arguments.py L1027) and megatron-core's
    initialize_model_parallel an expert mesh larger than the world (parallel_state.py)."""
    pytest.importorskip("megatron.core")
    argv = _args(ep_plan)
    argv[argv.index(flag) + 1] = value
    if value == "8":
        argv[argv.index("--num-experts") + 1] = "8"
    with pytest.raises(error, match=match):
        fs.megatron_startup(argv, ep_plan.num_gpus)


@pytest.fixture(scope="module")
def tp_ep_plan():
    """The tiny Mixtral at tp2 pp1 dp2 ep2 with sequence parallelism: the EP group is the
    TP pair (experts on each TP rank's sequence shard, Megatron-LM's expert-TP 1)."""
    pytest.importorskip("transformers")
    from benchmarks.hf_families import build_family

    layout = autopar.Layout.parse("tp=2,pp=1,dp=2,ep=2,sp=1,mbs=1,zero_stage=0,dtype=bf16")
    return autopar.evaluate(build_family("mixtral"), autopar.Cluster.local_cpu(processes=4),
                            layout, global_batch_size=8, seq_len=16)


@pytest.mark.parametrize("rank", [0, 3])
def test_megatron_starts_a_tp_ep_plan_with_autopars_groups(tp_ep_plan, rank):
    """At tp 2 the emitted flags (SP, expert-TP 1) start megatron-core with the EP and
    expert-data-parallel groups autopar prices and runs: consecutive ranks of the stage,
    spanning TP (expert_ranks of the stage rank tp_rank + t·dp_rank); a plan at tp 2 without
    SP or at ep 1 is outside the target."""
    pytest.importorskip("megatron.core")
    assert outside_target(tp_ep_plan, "megatron") is None
    argv = _args(tp_ep_plan)
    assert "--sequence-parallel" in argv and _value(argv, "--expert-tensor-parallel-size") == "1"
    run = fs.megatron_startup(argv, tp_ep_plan.num_gpus, rank=rank)
    assert (run.transformer_config.expert_model_parallel_size,
            run.transformer_config.expert_tensor_parallel_size) == (2, 1)
    _, ep_group, edp_group = expert_ranks(rank, 4, 2)
    assert (run.expert_group, run.expert_data_group) == (ep_group, edp_group)
    for changed in (dict(sequence_parallel=False), dict(ep=1)):
        assert "sequence parallelism" in outside_target(
            dataclasses.replace(tp_ep_plan, **changed), "megatron")


def test_emitted_flags_read_back(ep_plan):
    """read_megatron_args of the emitted flags: ep 2 and the experts."""
    run = read_megatron_args(" ".join(_args(ep_plan)), num_gpus=4)
    assert (run.layout.tp, run.layout.pp, run.layout.dp, run.layout.ep,
            run.layout.zero_stage) == (1, 1, 4, 2, 0)
    assert (run.model["num_experts"], run.model["moe_router_topk"],
            run.model["moe_ffn_hidden_size"]) == (4, 2, 128)


def test_mixtral_8x7b_script_reads_with_its_ep():
    """Megatron-LM's Mixtral 8x7B script (core_v0.16.1) on 32 GPUs: tp 1, pp 4, d 8, ep 8,
    ZeRO-1 (--use-distributed-optimizer), b 1, B 256, bf16, 8 experts top-2 of width 14336;
    on its 8-GPU default d = 2 holds no EP group of 8, refused by name."""
    run = read_megatron_args(str(MIXTRAL_SCRIPT), num_gpus=32)
    lay = run.layout
    assert (lay.tp, lay.pp, lay.dp, lay.ep, lay.zero_stage, lay.micro_batch_size,
            lay.dtype) == (1, 4, 8, 8, 1, 1, "bf16")
    assert run.global_batch_size == 256 and run.seq_len == 4096
    assert (run.model["num_experts"], run.model["moe_router_topk"],
            run.model["ffn_hidden_size"]) == (8, 2, 14336)
    with pytest.raises(ValueError, match="expert-model-parallel-size 8 does not divide the 2"):
        read_megatron_args(str(MIXTRAL_SCRIPT), num_gpus=8)


BASE = ("--num-layers 2 --micro-batch-size 1 --num-experts 4 --expert-model-parallel-size 2 "
        "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall")


@pytest.mark.parametrize("flags, match", [
    (BASE.replace("alltoall", "allgather"), "alltoall dispatcher only"),
    (BASE.replace("alltoall", "flex"), "alltoall dispatcher only"),
    (BASE.replace("--expert-tensor-parallel-size 1", "--expert-tensor-parallel-size 2"),
     "expert-tensor-parallel-size 2"),
    (BASE + " --tensor-model-parallel-size 2",
     "--num-experts 4 with --tensor-model-parallel-size 2 and --expert-model-parallel-size 2 "
     "without --sequence-parallel"),
    (BASE.replace("--expert-model-parallel-size 2", "--expert-model-parallel-size 1")
     + " --tensor-model-parallel-size 2 --sequence-parallel", "ep > 1 and sequence parallelism"),
    (BASE.replace("--num-experts 4", "--num-experts 3"), "not divisible"),
    (BASE.replace("--num-experts 4 ", ""), "without --num-experts"),
    (BASE + " --moe-shared-expert-intermediate-size 64", "moe-shared-expert"),
])
def test_reader_refuses_unpriced_moe_flags(flags, match):
    with pytest.raises(ValueError, match=match):
        read_megatron_args(flags, num_gpus=4)


def test_moe_model_flags_of_other_families():
    """Shared experts with a gate, dense layers first and un-renormalised top-k become
    Megatron-LM's flags; DeepSeek-V3 and Qwen3-MoE are refused by name."""
    qwen2 = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64, "mlp_only_layers": [0],
             "norm_topk_prob": False}
    assert moe_model_args(qwen2) == [
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
        "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-router-pre-softmax"]
    assert "multi-latent attention" in moe_model_problem(
        {"model_type": "deepseek_v3", "n_routed_experts": 8, "num_hidden_layers": 2})
    assert "q/k RMSNorm" in moe_model_problem(
        {"model_type": "qwen3_moe", "num_experts": 8, "num_hidden_layers": 2})


def test_torchtitan_and_deepspeed_refuse_ep(ep_plan):
    """torchtitan (MoE only in its own models; EP over its FSDP ranks) and DeepSpeed (its own
    MoE layer) refuse the plan by name; so does the torchtitan reader an EP degree."""
    with pytest.raises(ValueError, match="deepseek_v3, qwen3 and llama4"):
        emit(ep_plan, "torchtitan")
    with pytest.raises(ValueError, match="deepspeed.moe.layer.MoE"):
        emit(ep_plan, "deepspeed")
    with pytest.raises(ValueError, match="deepspeed.moe.layer.MoE"):
        deepspeed_config(ep_plan)
    fp32_grads = dataclasses.replace(ep_plan, grad_dtype="fp32")  # torchtitan's
    assert "cannot run ep=2" in outside_target(fp32_grads, "torchtitan")
    with pytest.raises(ValueError, match="expert_parallel_degree=2"):
        read_torchtitan_toml("[parallelism]\ndata_parallel_shard_degree = 4\n"
                             "expert_parallel_degree = 2\n")


def test_megatron_target_refuses_moe_with_tp_unless_ep_spans_it_under_sp(ep_plan):
    """A MoE plan at tp > 1 without EP or without SP is outside the megatron target and
    refused by the emitter (Megatron-LM's experts under TP run on sequence shards, which
    autopar prices only with the EP group spanning TP)."""
    for ep, sp in ((1, True), (2, False)):
        tp2 = dataclasses.replace(ep_plan, tp=2, dp=2, ep=ep, sequence_parallel=sp)
        assert "only with ep > 1 and sequence parallelism" in outside_target(tp2, "megatron")
        with pytest.raises(ValueError, match="only with ep > 1 and sequence parallelism"):
            emit(tp2, "megatron")


@pytest.fixture(scope="module")
def mixtral():
    pytest.importorskip("transformers")
    from benchmarks.hf_families import build_family

    return build_family("mixtral")


def test_searched_megatron_plan_uses_ep_and_starts(mixtral):
    """autopar.plan(..., target="megatron") of the tiny Mixtral on 8 ranks searches ep (the
    target's expert_parallel) and megatron-core starts what it emits; a tp = 2 pin plans
    only with ep > 1 and SP (its moe_tp), an ep = 1 pin with it is refused by name."""
    pytest.importorskip("megatron.core")
    cluster = autopar.Cluster.local_cpu(processes=8)
    plan = autopar.plan(mixtral, cluster, global_batch_size=16, seq_len=16, target="megatron")
    assert plan.ep > 1
    run = fs.megatron_startup(_args(plan), plan.num_gpus)
    assert run.transformer_config.expert_model_parallel_size == plan.ep
    tp2 = autopar.plan(mixtral, cluster, global_batch_size=16, seq_len=16, target="megatron",
                       layout=autopar.Layout(tp=2))
    assert tp2.tp == 2 and tp2.ep > 1 and tp2.sequence_parallel
    with pytest.raises(ValueError, match="only with ep > 1 and sequence parallelism"):
        autopar.plan(mixtral, cluster, global_batch_size=16, seq_len=16, target="megatron",
                     layout=autopar.Layout(tp=2, ep=1))


def test_read_back_flags_price_as_the_plan(ep_plan, mixtral):
    """price_run of the emitted flags, read back, on the same model: the plan's step time;
    flags stating other experts than the model's are refused."""
    from autopar.frameworks import price_run, read

    cluster = autopar.Cluster.local_cpu(processes=4)
    run = read(emit(ep_plan, "megatron"), "megatron", ep_plan.num_gpus)
    priced = price_run(run, cluster, model=mixtral)
    assert priced.ep == 2
    assert priced.predicted.step_time_s == pytest.approx(ep_plan.predicted.step_time_s)
    other = dataclasses.replace(run, model={**run.model, "moe_router_topk": 1})
    with pytest.raises(ValueError, match="top-2"):
        price_run(other, cluster, model=mixtral)
