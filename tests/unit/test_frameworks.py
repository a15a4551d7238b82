"""Megatron-LM flags in, Megatron-LM / torchtitan / DeepSpeed configurations out.

Round trips (emit -> read back -> the same layout, stages and per-layer recompute) on
random plans inside each target's space (hypothesis) and on the example reports' plans;
Megatron-LM's published SC21 Table 1 flags read as the paper's layouts; the readers'
refusals; and searches under ``target=`` that stay inside the target's space.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import autopar
from autopar.frameworks import (FRAMEWORKS, TARGETS, emit, model_problem, outside_target, read,
                                read_megatron_args)
from autopar.frameworks.megatron import parse_pp_layout, pp_layout
from autopar.frameworks.targets import megatron_block_layers
from autopar.models import pad_vocab_size
from autopar.contract.plan import Plan
from autopar.contract.stages import equal_chunks, even_stage_layers
from autopar.techniques.pipeline_schedules import pipeline_schedule
from helpers import TINY_BATCH, TINY_SEQ, tiny_meta_gpt

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def base_plan() -> Plan:
    """A real plan whose layout fields the strategies below replace."""
    return autopar.plan(tiny_meta_gpt(), autopar.Cluster.local_cpu(processes=2),
                        global_batch_size=TINY_BATCH, seq_len=TINY_SEQ, model_name="gpt-tiny")


@st.composite
def _cuts(draw, num_layers: int, parts: int) -> list[list[int]]:
    """A random split of L layers into ``parts`` contiguous non-empty stages."""
    edges = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=parts - 1,
                                max_size=parts - 1)))
    bounds = [0, *edges, num_layers]
    return [[a, b] for a, b in zip(bounds, bounds[1:])]


@st.composite
def target_plans(draw, base: Plan, target: str, max_world: int | None = None,
                 tiny: bool = False) -> Plan:
    """A plan inside ``target``'s space (TARGETS), fields consistent (B = d·b·m, stages);
    at most ``max_world`` ranks when given; ``tiny``: 16-wide heads and 512 tokens, a model
    small enough to build (the shapes' head counts and layers are the same)."""
    support = TARGETS[target]
    L = draw(st.integers(2, 40))
    heads = draw(st.sampled_from([8, 16, 32]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= (support.max_tp or 8)]))
    pp = draw(st.integers(1, min(L, 8)))
    record = pipeline_schedule(draw(st.sampled_from(support.schedules)))
    dp = draw(st.integers(1, 16 if max_world is None else max(1, max_world // (tp * pp))))
    mbs = draw(st.integers(1, 4))
    m = draw(st.integers(pp, 16))
    m += (-m) % pp if record.interleaved else 0
    vs = [v for v in (support.virtual_stages if record.interleaved else (1,))
          if record.problem(pp, m, v, L) is None]  # the record's rule
    if not vs:
        record, vs = pipeline_schedule("1f1b"), [1]  # m >= pp: 1F1B runs
    schedule, v = record.name, draw(st.sampled_from(vs))
    if not support.zero_stages_for(pp, tp, dp):  # no ZeRO stage runs this mesh
        dp = 1
    zero = draw(st.sampled_from(support.zero_stages_for(pp, tp, dp)))
    if dp == 1 and target == "torchtitan":
        zero = 0  # FSDP over one rank is DDP: torchtitan states no ZeRO stage then
    if support.even_stages:
        stages = even_stage_layers(L, pp, v)
    elif v > 1:
        stages = equal_chunks(L, pp * v)
    else:
        stages = draw(_cuts(L, pp)) if pp > 1 else [[0, L]]
    mode = draw(st.sampled_from(record.recompute_modes(support.recompute)))
    recompute = [mode] * L
    if support.recompute_layout == "block" and v == 1 and "full" in record.recompute_modes(
            support.recompute) and draw(st.booleans()):
        k = draw(st.integers(0, max(b - a for a, b in stages)))
        recompute = ["none"] * L
        for lo, hi in stages:
            recompute[lo:min(hi, lo + k)] = ["full"] * (min(hi, lo + k) - lo)
    sp = tp > 1 and draw(st.sampled_from(support.sequence_parallel))
    dtype = support.dtype_for(draw(st.sampled_from(support.dtypes)), tp, pp, dp)
    if target == "torchtitan":  # it defines Llama-family models only
        config = {"num_hidden_layers": L, "hidden_size": (16 if tiny else 64) * heads,
                  "num_attention_heads": heads,
                  # whole kv heads per TP rank (megatron-core: num_query_groups % tp)
                  "num_key_value_heads": draw(st.sampled_from([heads, max(tp, heads // 4)])),
                  "intermediate_size": draw(st.sampled_from([128, 172, 256])) * heads
                  // (4 if tiny else 1),
                  "vocab_size": 512 if tiny else draw(st.sampled_from([32000, 128256])),
                  "max_position_embeddings": 2048, "hidden_act": "silu",
                  "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    else:
        config = {"n_layer": L, "n_head": heads, "n_embd": (16 if tiny else 64) * heads,
                  "vocab_size": 512 if tiny else 51200,
                  "block_size": 2048, "dropout": draw(st.sampled_from([0.0, 0.1]))}
    kernel = draw(st.sampled_from(support.kernels_in(dtype) or (base.cluster["attention"],)))
    return dataclasses.replace(
        base, model="gpt-random", model_config=config, tp=tp, pp=pp, dp=dp,
        micro_batch_size=mbs, num_micro_batches=m, global_batch_size=dp * mbs * m,
        seq_len=2048, schedule=schedule, virtual_stages=v, zero_stage=zero,
        recompute=recompute, stage_layers=stages, sequence_parallel=sp, dtype=dtype,
        grad_dtype="fp32" if dtype == "fp32" else draw(st.sampled_from(support.grad_dtypes)),
        attention=None if kernel == base.cluster["attention"] else kernel)


def _assert_round_trip(plan: Plan, framework: str) -> None:
    run = read(emit(plan, framework), framework, plan.num_gpus)
    L = len(plan.recompute)
    assert run.layout == plan.layout(), (run.layout, plan.layout())
    assert (run.stage_layers or even_stage_layers(L, plan.pp, plan.virtual_stages)) \
        == plan.stage_layers
    assert run.recompute_modes(L) == plan.recompute
    assert run.global_batch_size == plan.global_batch_size
    # the kernel the configuration runs: Megatron-LM's --attention-backend, torchtitan's by
    # dtype; DeepSpeed runs the model's own (None: the cluster's)
    assert (run.attention or plan.cluster["attention"]) == plan.attention_kernel


@pytest.mark.parametrize("target", FRAMEWORKS)
def test_random_plans_in_each_target_round_trip(base_plan, target):
    """emit -> read back gives the plan's layout, stages and recompute, for 150 random plans
    inside the target's space; each is inside by :func:`outside_target` too."""
    checked = []

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(target_plans(base_plan, target))
    def check(plan):
        assert outside_target(plan, target) is None
        _assert_round_trip(plan, target)
        checked.append(plan)
    check()
    assert len(checked) == 150
    print(f"{target}: {len(checked)} random plans round-tripped")


def test_megatron_flags_carry_the_model_shape(base_plan):
    plan = dataclasses.replace(base_plan, attention="math", model_config={
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256,
        "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 688,
        "vocab_size": 1024, "max_position_embeddings": 512, "tie_word_embeddings": False})
    chunks = plan.pp * plan.virtual_stages  # a plan of the 4 layers the config names
    plan = dataclasses.replace(plan, recompute=plan.recompute[:1] * 4,
                               stage_layers=[[4 * c // chunks, 4 * (c + 1) // chunks]
                                             for c in range(chunks)])
    run = read(emit(plan, "megatron"), "megatron", plan.num_gpus)
    assert run.model == {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                         "ffn_hidden_size": 688, "num_query_groups": 2, "seq_length": 512,
                         "vocab_size": 1024, "swiglu": True, "untied": True, "dropout": 0.0}


def test_example_report_plans_round_trip_or_name_the_target():
    """Every plan of the example reports (reports/*/plan.json, the autopar plan, and
    plan-<framework>.json, the best plan that framework runs where the autopar plan is
    outside its space), for every framework: emit -> read back gives the same plan, or the
    emitter refuses naming the rule and ``--target``; each plan-<framework>.json is inside
    its framework's space."""
    paths = sorted((REPO / "reports").glob("*/plan*.json"))
    assert sum(p.name == "plan.json" for p in paths) == 3, paths
    trips = 0
    for path in paths:
        plan = Plan.from_json(path.read_text(), str(path))
        for framework in FRAMEWORKS:
            model = model_problem(plan.model_config, framework)
            if model:  # GPT-2/3 in torchtitan: another model, refused whatever the layout
                assert not path.name.startswith(f"plan-{framework}")
                with pytest.raises(ValueError, match=re.escape(model[:40])):
                    emit(plan, framework)
                continue
            problem = outside_target(plan, framework)
            assert path.name != f"plan-{framework}.json" or problem is None, problem
            if problem is None:
                _assert_round_trip(plan, framework)
                trips += 1
            else:
                assert f"--target {framework}" in problem
                with pytest.raises(ValueError, match=f"--target {framework}"):
                    emit(plan, framework)
    assert trips >= len(paths)  # every plan-<framework>.json, at least
    print(f"{len(paths)} example plans, {trips} round trips")


# ----------------------------------------------------------------- Megatron-LM's own flags
SC21 = {  # examples/academic_paper_scripts/sc21/run_table_1.sh (NVIDIA/Megatron-LM)
    "1.7B": dict(TP=1, PP=1, MBS=16, GBS=512, NLS=24, HS=2304, NAH=24, NNODES=4, EXTRA=""),
    "76B": dict(TP=8, PP=4, MBS=2, GBS=1792, NLS=60, HS=10240, NAH=80, NNODES=128,
                EXTRA="--num-layers-per-virtual-pipeline-stage 5"),
    "530B": dict(TP=8, PP=35, MBS=1, GBS=2520, NLS=105, HS=20480, NAH=128, NNODES=315,
                 EXTRA="--num-layers-per-virtual-pipeline-stage 1"),
    "1T": dict(TP=8, PP=64, MBS=1, GBS=3072, NLS=128, HS=25600, NAH=160, NNODES=384, EXTRA=""),
}


@pytest.mark.parametrize("size", list(SC21))
def test_sc21_table_1_flags_read_as_the_papers_layouts(size):
    """MEGATRON_PARAMS of the SC21 scripts (CONFIG.sh, with run_table_1.sh's values and
    its --activations-checkpoint-method uniform) read as the published layouts."""
    values = SC21[size]
    text = string.Template((DATA / "megatron_sc21_config.sh").read_text()).substitute(
        MEGATRON_EXTRA_PARAMS="--activations-checkpoint-method uniform " + values["EXTRA"],
        DDP="local", MEGATRON_DATA="data", BPE_VOCAB_FILE="vocab.json",
        BPE_MERGE_FILE="merges.txt", **{k: v for k, v in values.items() if k != "EXTRA"})
    run = read_megatron_args(text, num_gpus=8 * values["NNODES"])
    t, p = values["TP"], values["PP"]
    per = int(values["EXTRA"].split()[-1]) if values["EXTRA"] else None
    v = values["NLS"] // (p * per) if per else 1
    assert run.layout == autopar.Layout(
        tp=t, pp=p, dp=8 * values["NNODES"] // (t * p), micro_batch_size=values["MBS"],
        zero_stage=0, recompute="full", schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v, sequence_parallel=False, dtype="bf16", grad_dtype="bf16", ep=1,
        cp=1)
    assert run.global_batch_size == values["GBS"] and run.seq_len == 2048
    assert run.model["num_layers"] == values["NLS"] and run.model["hidden_size"] == values["HS"]
    assert run.model["vocab_size"] == pad_vocab_size(50257, 128 * t)  # as Megatron-LM pads
    assert any("--DDP-impl" in flag for flag in run.ignored)


def test_megatron_block_recompute_and_uneven_layout_are_read_per_layer():
    run = read_megatron_args(
        "--num-layers 16 --micro-batch-size 2 --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout 'Et*3|(t*4|)*2t*5L' "
        "--recompute-granularity full --recompute-method block --recompute-num-layers 4 "
        "--sequence-parallel --use-distributed-optimizer --bf16", num_gpus=16)
    assert run.stage_layers == [[0, 3], [3, 7], [7, 11], [11, 16]]
    assert run.recompute == ["full"] * 3 + (["full"] * 4) * 2 + ["full"] * 4 + ["none"]
    assert megatron_block_layers(run.recompute, run.stage_layers) == 4
    assert run.layout.zero_stage == 1 and run.layout.sequence_parallel and run.layout.dp == 2
    assert pp_layout([3, 4, 4, 5]) == "Et*3|t*4|t*4|t*5L"
    assert parse_pp_layout("Et*3|t*4|t*4|t*5L", 16, 4) == [3, 4, 4, 5]


@pytest.mark.parametrize("flags, match", [
    ("--num-layers 8", "--micro-batch-size"),
    ("--num-layers 8 --micro-batch-size ${MBS}", "shell variable"),
    ("--num-layers 10 --micro-batch-size 1 --pipeline-model-parallel-size 4",
     "not divisible by pp"),
    ("--num-layers 8 --micro-batch-size 1 --recompute-granularity full", "recompute-method"),
    ("--num-layers 8 --micro-batch-size 1 --pipeline-model-parallel-size 2 "
     "--pipeline-model-parallel-layout 't*4|Et*4L'", "embedding"),
    ("--num-layers 8 --micro-batch-size 1 --tensor-model-parallel-size 3", "not divisible"),
    ("no-such-file.args", "neither Megatron-LM flags nor a file"),
])
def test_megatron_flags_refused_with_the_cause(flags, match):
    with pytest.raises(ValueError, match=match):
        read_megatron_args(flags, num_gpus=8)


@pytest.mark.parametrize("framework, text, match", [
    ("torchtitan", "[parallelism]\ndata_parallel_shard_degree = 2\n"
                   "data_parallel_replicate_degree = 2\n", "HSDP"),
    ("torchtitan", "[parallelism]\ndata_parallel_shard_degree = 2\n"
                   "[activation_checkpoint]\nmode = 'selective'\n", "modes none, full"),
    ("torchtitan", "not = [toml", "not a torchtitan job TOML"),
    ("deepspeed", json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
                              "gradient_accumulation_steps": 1}), "not micro batch"),
    ("deepspeed", json.dumps({"train_batch_size": 8}), "train_micro_batch_size_per_gpu"),
])
def test_framework_configs_refused_with_the_cause(framework, text, match):
    with pytest.raises(ValueError, match=match):
        read(text, framework, 8)


# ----------------------------------------------------------------------- target searches
def _small_problem(memory_gib: float, llama: bool = False):
    """A 4-layer h=64 GPT (``llama``: a Llama-family model of that size, what torchtitan
    defines) on 4 local ranks whose memory (no reserve) is ``memory_gib``."""
    import torch
    from autopar.frameworks.model_shape import build_model
    from autopar.models import GPT, GPTConfig
    from cost_models.reserve import MemoryReserve

    if llama:
        model, _ = build_model({"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                                "ffn_hidden_size": 172, "num_query_groups": 2,
                                "seq_length": 64, "vocab_size": 256, "swiglu": True,
                                "untied": True})
    else:
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256,
                                  block_size=64))
    cluster = autopar.Cluster.local_cpu(processes=4)
    return model, dataclasses.replace(
        cluster, device=dataclasses.replace(cluster.device, memory_gib=memory_gib),
        memory_reserve=MemoryReserve.none())


@pytest.mark.parametrize("target", ["megatron", "torchtitan", "deepspeed"])
def test_plan_for_a_target_stays_inside_it(target):
    """A search for ``target`` where memory forces recompute (6 MiB per rank: autopar
    recomputes one (the Llama for torchtitan: two) of the 4 layers) returns a plan the target runs, never
    faster than autopar's own (a subset of its space), whose configuration reads back."""
    model, cluster = _small_problem(0.006, llama=target == "torchtitan")
    kwargs = dict(global_batch_size=16, seq_len=64, model_name="gpt-small")
    own = autopar.plan(model, cluster, **kwargs)
    assert sorted(own.recompute) == (["full", "full", "none", "none"] if target == "torchtitan"
                                     else ["full", "none", "none", "none"])
    plan = autopar.plan(model, cluster, target=target, **kwargs)
    assert outside_target(plan, target) is None
    assert outside_target(own, target) is not None  # the restriction binds here
    assert plan.predicted.step_time_s > own.predicted.step_time_s
    _assert_round_trip(plan, target)
    print(f"{target}: {plan.headline()} (autopar: {own.headline()})")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_target_keeps_megatrons_placements(sequence_parallel):
    from autopar.graph.capture import trace_model
    from autopar.planner.strategies.megatron import megatron_placements

    model, cluster = _small_problem(1.0)
    plan = autopar.plan(model, cluster, global_batch_size=16, seq_len=64, target="megatron",
                        layout=autopar.Layout(tp=2, sequence_parallel=sequence_parallel))
    traced = trace_model(model, 64, dtype=plan.dtype)
    megatron = megatron_placements(traced, 2, sequence_parallel)
    cut = {traced.pre[-1], *(layer[-1] for layer in traced.layers)}  # sent whole if not SP
    assert {n: k for n, k in plan.placements.items() if n not in cut} == \
        {n: k for n, k in megatron.items() if n not in cut}
    assert all(plan.placements[n] in (megatron[n], "replicate:R") for n in cut), \
        {n: plan.placements[n] for n in cut}
    assert autopar.evaluate_plan(model, cluster, plan).predicted == plan.predicted


def test_unknown_target_is_refused_before_tracing():
    with pytest.raises(ValueError, match="unknown target 'megatron-lm'; choose one of"):
        autopar.plan(tiny_meta_gpt(), "local-cpu", global_batch_size=TINY_BATCH,
                     seq_len=TINY_SEQ, target="megatron-lm")


# ------------------------------------------------------------------------------ the CLI
def test_cli_plan_emits_and_compare_reads_megatron_args(tmp_path, capsys):
    """`autopar plan --emit megatron --emit-to F` writes flags that `autopar compare
    --megatron-args F` reads back and prices as the same plan (auto/hand = 1)."""
    from autopar import cli

    out = tmp_path / "megatron.args"
    base = ["--model", "gpt-small-test", "--cluster", "local-cpu", "--global-batch-size", "16",
            "--seq-len", "64"]
    assert cli.main(["plan", *base, "--emit", "megatron", "--emit-to", str(out), "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert outside_target(plan, "megatron") is None
    assert read_megatron_args(str(out), plan.num_gpus).layout == plan.layout()
    assert cli.main(["compare", "--cluster", "local-cpu", "--megatron-args", str(out),
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["global_batch_size"] == 16 and result["seq_len"] == 64
    (row,) = result["hand"]
    assert row["ignored"] == []  # autopar's own flags are all priced
    assert row["layout"] == result["auto"]["layout"] or row["auto_over_hand"] <= 1 + 1e-9
    assert row["step_time_s"] == pytest.approx(plan.predicted.step_time_s, rel=1e-12)


@pytest.mark.parametrize("argv, match", [
    (["--emit-to", "x.toml"], "--emit-to needs --emit"),
    (["--emit", "deepspeed", "--json"], "give --emit-to FILE"),
])
def test_cli_emit_flags_refused_before_planning(argv, match, capsys):
    from autopar import cli

    code = cli.main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu",
                     "--global-batch-size", "8", *argv])
    assert code == 2
    assert match in capsys.readouterr().err


# ------------------------------------------ accepted by the frameworks' own configuration code
def _accepted_by_the_framework(plan: Plan, framework: str) -> None:
    """``emit(plan, framework)`` handed to the framework's own configuration code
    (tests/framework_configs.py): megatron-core's TransformerConfig builds the plan's layers
    per (pipeline rank, virtual stage) and its micro-batch calculator the plan's m;
    torchtitan's parser and start-up checks split the model into the plan's chunks;
    DeepSpeedConfig takes the batch, accumulation, ZeRO stage and precision."""
    import shlex

    import framework_configs as fc

    text, p = emit(plan, framework), plan.pp
    counts = [[hi - lo for lo, hi in plan.stage_layers[r::p]] for r in range(p)]
    if framework == "megatron":
        lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        argv = shlex.split(" ".join(lines).replace("\\", " "))
        config = fc.megatron_config(fc.megatron_fields_from_flags(argv))
        assert fc.megatron_stage_layers(config) == counts
        assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                config.sequence_parallel) == (plan.tp, p, plan.sequence_parallel)
        assert fc.megatron_microbatches(plan.global_batch_size, plan.micro_batch_size,
                                        plan.dp) == plan.num_micro_batches
    elif framework == "torchtitan":
        config = fc.torchtitan_config(text, world_size=plan.num_gpus)
        parts = fc.torchtitan_stage_modules(config, plan.num_gpus)
        if p > 1:
            assert [len([m for m in part if m.startswith("layers.")]) for part in parts] == \
                [hi - lo for lo, hi in plan.stage_layers]
        assert config.activation_checkpoint.mode == plan.recompute[0]
    else:
        config = fc.deepspeed_config(json.loads(text), plan.num_gpus, pipeline_parallel_size=p)
        assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                config.gradient_accumulation_steps, config.zero_optimization_stage) == (
            plan.global_batch_size, plan.micro_batch_size, plan.num_micro_batches,
            plan.zero_stage)
        assert config.bfloat16_config.enabled == (plan.dtype == "bf16")


@pytest.mark.parametrize("target", FRAMEWORKS)
def test_emitted_configurations_are_accepted_by_the_frameworks(base_plan, target):
    """40 random plans inside each target's space, emitted and handed to the framework's
    own configuration code (installed by tests/install_frameworks.sh)."""
    checked = []

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(target_plans(base_plan, target))
    def check(plan):
        _accepted_by_the_framework(plan, target)
        checked.append(plan)
    check()
    assert len(checked) == 40
    print(f"{target}: {len(checked)} emitted configurations accepted")


def test_example_plans_are_accepted_by_the_frameworks():
    """Every example report's plan that a framework runs, in that framework's own code."""
    accepted = 0
    for path in sorted((REPO / "reports").glob("*/plan*.json")):
        plan = Plan.from_json(path.read_text(), str(path))
        for framework in FRAMEWORKS:
            if model_problem(plan.model_config, framework) is None and \
                    outside_target(plan, framework) is None:
                _accepted_by_the_framework(plan, framework)
                accepted += 1
    assert accepted >= 9


def test_megatron_gpt3_175b_example_script_reads_as_written():
    """NVIDIA/Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, as it stands (bash
    arrays, shell variables in flags autopar does not price, comments): its layout on 1024
    GPUs, no recompute (the script sets none), fp16 read as bf16, ``--attention-backend auto``
    as the flash kernel Transformer Engine picks for 16-bit inputs, the rest listed."""
    run = read_megatron_args(str(DATA / "megatron_train_gpt3_175b_distributed.sh"), 1024)
    assert run.layout == autopar.Layout(tp=8, pp=16, dp=8, micro_batch_size=1, zero_stage=0,
                                        recompute="none", schedule="1f1b", virtual_stages=1,
                                        sequence_parallel=False, dtype="bf16",
                                        grad_dtype="bf16", ep=1, cp=1)  # --fp16: fp16 grads
    assert (run.global_batch_size, run.seq_len) == (1536, 2048)
    assert {k: run.model[k] for k in ("num_layers", "hidden_size", "num_attention_heads")} == \
        {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96}
    ignored = " ".join(run.ignored)
    assert run.attention == "flash"
    for flag in ("--step-batch-size-schedule", "--data-path", "--lr", "--fp16: priced as bf16"):
        assert flag in ignored, flag


LLAMA3_8B = (DATA / "megatron_train_llama3_8b_h100_fp8.sh").read_text()
"""Megatron-LM core_v0.16.1 examples/llama/train_llama3_8b_h100_fp8.sh, as it stands."""


def _llama3_8b(*edits: tuple[str, str]) -> str:
    """The Llama 3 8B script in bf16 (its four quoted --fp8-* array elements removed, as
    DTYPE="bf16" would leave them out: autopar reads flags, not the script's if), with
    further (old, new) text edits; each must apply."""
    text = LLAMA3_8B
    for flag in ('"--fp8-format hybrid"', '"--fp8-amax-history-len 1024"',
                 '"--fp8-amax-compute-algo max"', '"--fp8-param-gather"'):
        assert flag in text, flag
        text = text.replace(flag, "")
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_megatron_llama3_8b_example_script_refused_for_fp8_as_written():
    """As it stands the script trains in FP8 (its DTYPE="fp8" adds the quoted
    "--fp8-format hybrid" array elements): refused by name, not priced as bf16."""
    with pytest.raises(ValueError, match="--fp8-format hybrid: FP8 training is not priced"):
        read_megatron_args(str(DATA / "megatron_train_llama3_8b_h100_fp8.sh"), 8)


def test_megatron_llama3_8b_example_script_reads_in_bf16():
    """The script's own variables substituted (TP_SIZE, MICRO_BATCH_SIZE, SEQ_LENGTH ...),
    its quoted "--vocab-size 128256" element split, --sequence-parallel dropped at tp = 1,
    --grad-reduce-in-bf16 read as bf16 gradients, the distributed optimizer as ZeRO-1."""
    run = read_megatron_args(_llama3_8b(), 8)
    assert run.layout == autopar.Layout(tp=1, pp=1, dp=8, micro_batch_size=1, zero_stage=1,
                                        recompute="none", schedule="1f1b", virtual_stages=1,
                                        sequence_parallel=False, dtype="bf16",
                                        grad_dtype="bf16", ep=1, cp=1)
    assert (run.global_batch_size, run.seq_len) == (128, 8192)
    assert {k: run.model[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                      "num_query_groups", "vocab_size", "swiglu", "untied")} == {
        "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
        "num_query_groups": 8, "vocab_size": 128256, "swiglu": True, "untied": True}
    # without --grad-reduce-in-bf16: Megatron-LM's fp32 main gradients
    default = read_megatron_args(_llama3_8b(("    --grad-reduce-in-bf16\n", "")), 8)
    assert default.layout.grad_dtype == "fp32"


@pytest.mark.parametrize("edit, match", [
    (("    --context-parallel-size $CP_SIZE\n", "    --context-parallel-size 2\n"
      "    --cp-comm-type a2a\n"), "--cp-comm-type a2a: context parallelism by a2a"),
    (("    --use-distributed-optimizer\n", "    --use-megatron-fsdp\n"), "Megatron-FSDP"),
    (("    --use-distributed-optimizer\n", "    --use-torch-fsdp2\n"), "FSDP2"),
    (("    --disable-bias-linear \n", "    --disable-bias-linear\n    --num-experts 8\n"
      "    --expert-model-parallel-size 2\n    --expert-tensor-parallel-size 1\n"),
     "--moe-token-dispatcher-type allgather: autopar prices the alltoall dispatcher only"),
    (("    --bf16\n", "    --bf16\n    --recompute-granularity selective\n"
                     "    --recompute-modules core_attn mlp\n"), "core_attn mlp"),
    (("    --bf16\n", "    --bf16\n    --recompute-granularity full\n"
                     "    --recompute-method block\n"), "needs --recompute-num-layers"),
])
def test_megatron_flags_autopar_cannot_price_are_refused_by_name(edit, match):
    with pytest.raises(ValueError, match=match):
        read_megatron_args(_llama3_8b(edit), 8)


def test_megatron_flags_read_as_megatron_reads_them():
    # --swiglu without --ffn-hidden-size: int(8h/3/64)*64 (arguments.py), not 4h
    run = read_megatron_args(_llama3_8b(("    --ffn-hidden-size 14336\n", "")), 8)
    assert run.model["ffn_hidden_size"] == int(4 * 4096 * 2 / 3 / 64) * 64 == 10880
    # --num-query-groups without --group-query-attention: one key/value head per query head
    run = read_megatron_args(_llama3_8b(("    --group-query-attention\n", "")), 8)
    assert "num_query_groups" not in run.model
    assert any("--group-query-attention" in note for note in run.ignored)
    # Megatron's default module list is what selective recompute prices
    run = read_megatron_args(_llama3_8b(("    --bf16\n", "    --bf16\n    --recompute-granularity "
                                         "selective\n    --recompute-modules core_attn\n")), 8)
    assert run.layout.recompute == "selective"
    # an interleaved layout: p*v stages, stage i on rank i % p (megatron-core's layout)
    layout = "Et*3|t*4|t*4|t*4|t*4|t*4|t*4|t*5L"
    run = read_megatron_args(_llama3_8b(
        ("    --context-parallel-size $CP_SIZE\n",
         f"    --pipeline-model-parallel-size 4\n    --pipeline-model-parallel-layout "
         f"'{layout}'\n")), 8)
    assert (run.layout.pp, run.layout.virtual_stages, run.layout.schedule) == (
        4, 2, "interleaved_1f1b")
    assert [hi - lo for lo, hi in run.stage_layers] == [3, 4, 4, 4, 4, 4, 4, 5]
    # context parallelism: c ranks of the GPUs' t·c·p·d; the default p2p ring priced as
    # the all-gather autopar emits, and said so
    run = read_megatron_args(_llama3_8b(("CP_SIZE=1", "CP_SIZE=2")), 16)
    assert (run.layout.cp, run.layout.dp) == (2, 16 // (run.layout.tp * 2 * run.layout.pp))
    assert any("--cp-comm-type p2p (cp=2): priced as all_gather" in n for n in run.ignored)
    run = read_megatron_args(_llama3_8b(("    --context-parallel-size $CP_SIZE\n",
                                         "    --context-parallel-size 2\n    --cp-comm-type "
                                         "all_gather\n")), 16)
    assert run.layout.cp == 2 and not any("cp-comm-type" in n for n in run.ignored)


def test_megatron_mixtral_example_script_read_with_its_expert_parallelism():
    """examples/mixtral/train_mixtral_8x7b_distributed.sh as it stands, on 32 GPUs: ep 8
    over d 8 (the figures: tests/unit/test_megatron_ep.py)."""
    run = read_megatron_args(str(DATA / "megatron_train_mixtral_8x7b_distributed.sh"), 32)
    assert (run.layout.dp, run.layout.ep, run.model["num_experts"]) == (8, 8, 8)
