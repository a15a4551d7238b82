"""The frameworks' own configuration code accepts good configurations and rejects bad ones.

tests/framework_configs.py hands configurations to megatron-core, torchtitan and DeepSpeed
(installed by tests/install_frameworks.sh); these tests pin what each accepts, in the forms
autopar emits (Megatron-LM flags, a torchtitan job TOML, a DeepSpeed JSON dict), and show
that each check can fail.
"""

from __future__ import annotations

import pytest
import torch

import framework_configs as fc

# --------------------------------------------------------------------------------------
# Megatron
# --------------------------------------------------------------------------------------

LLAMA8B_FLAGS = [
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--bf16",
]
SMALL = {"num_layers": 16, "hidden_size": 1024, "num_attention_heads": 16, "bf16": True}


def test_megatron_flags_become_an_accepted_transformer_config():
    flags = LLAMA8B_FLAGS + [
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
        "--num-layers-per-virtual-pipeline-stage", "2", "--sequence-parallel",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "512",
    ]
    cfg = fc.megatron_config(fc.megatron_fields_from_flags(flags))
    assert cfg.tensor_model_parallel_size == 8
    assert cfg.pipeline_model_parallel_size == 4
    assert cfg.virtual_pipeline_model_parallel_size == 4  # 32 layers / pp 4 / 2 layers a chunk
    assert cfg.sequence_parallel
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)
    assert cfg.num_query_groups == 8 and cfg.ffn_hidden_size == 14336
    assert cfg.params_dtype == cfg.pipeline_dtype == torch.bfloat16
    assert fc.megatron_stage_layers(cfg) == [[2, 2, 2, 2]] * 4
    assert fc.megatron_microbatches(512, 1, 64 // (8 * 4)) == 256


def test_megatron_flag_translation_follows_arguments_py():
    fields = fc.megatron_fields_from_flags(
        ["--num-layers", "32", "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "8",
         "--num-query-groups", "8", "--recompute-activations", "--sequence-parallel"])
    assert fields["virtual_pipeline_model_parallel_size"] is None  # one chunk per rank means none
    assert fields["num_query_groups"] is None  # counts only with --group-query-attention
    assert fields["recompute_granularity"] == "selective"
    assert not fields["sequence_parallel"]  # dropped at tp = 1
    assert fields["params_dtype"] == torch.float32
    with pytest.raises(ValueError, match="--bogus"):
        fc.megatron_fields_from_flags(["--num-layers", "2", "--bogus"])


@pytest.mark.parametrize("split", [
    {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 5},
    {"pipeline_model_parallel_layout": "Ettt|tttt|tttt|tttttL"},  # embedding first, loss last
], ids=["first-last", "layout"])
def test_megatron_uneven_pipeline_stages(split):
    cfg = fc.megatron_config({**SMALL, "pipeline_model_parallel_size": 4, **split})
    assert fc.megatron_stage_layers(cfg) == [[3], [4], [4], [5]]


def test_megatron_layout_sets_the_virtual_size():
    fields = fc.megatron_fields_from_flags(
        ["--num-layers", "16", "--hidden-size", "1024", "--num-attention-heads", "16", "--bf16",
         "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "Et|tt|tt|tt|tt|tt|tt|tttL"])
    cfg = fc.megatron_config(fields)
    assert cfg.virtual_pipeline_model_parallel_size == 2
    assert fc.megatron_stage_layers(cfg) == [[1, 2], [2, 2], [2, 2], [2, 3]]


@pytest.mark.parametrize("fields, error, match", [
    ({"recompute_granularity": "full"}, ValueError, "recompute_method must be"),
    ({"recompute_granularity": "full", "recompute_method": "block"}, ValueError, "recompute_num_layers must be"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2}, ValueError, "must be None"),
    ({"sequence_parallel": True}, ValueError, "without tensor parallelism"),
    ({"tensor_model_parallel_size": 32}, ValueError, "num_attention_heads"),
    ({"pipeline_model_parallel_size": 3}, AssertionError, "divisible by pipeline_model_parallel_size"),
    ({"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 3}, AssertionError, "vp_size"),
    ({"pipeline_model_parallel_size": 4, "num_layers_in_first_pipeline_stage": 3,
      "num_layers_in_last_pipeline_stage": 6}, ValueError, "middle"),
    ({"pipeline_model_parallel_size": 4, "pipeline_model_parallel_layout": "Ettt|tttt|tttt|ttttL"},
     AssertionError, "must match num_layers"),
    ({"fp16": True}, ValueError, "Only one of"),
    ({"tensor_parallel_size": 2}, TypeError, "tensor_parallel_size"),
])
def test_megatron_rejects(fields, error, match):
    with pytest.raises(error, match=match):
        fc.megatron_config({**SMALL, **fields})


def test_megatron_microbatches_rejects_an_indivisible_batch():
    with pytest.raises(AssertionError, match="not divisible"):
        fc.megatron_microbatches(500, 1, 8)


# --------------------------------------------------------------------------------------
# torchtitan
# --------------------------------------------------------------------------------------

JOB = """\
[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 8
global_batch_size = 64
seq_len = 8192
mixed_precision_param = "bfloat16"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = 2
tensor_parallel_degree = 8
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 1
{extra}
[activation_checkpoint]
mode = "full"
"""


def _job(extra: str = "", **replace: str) -> str:
    text = JOB.format(extra=extra)
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


def test_torchtitan_accepts_a_job():
    cfg = fc.torchtitan_config(_job(), world_size=64)
    p = cfg.parallelism
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.data_parallel_shard_degree) == (8, 4, 2)
    assert p.pipeline_parallel_schedule == "Interleaved1F1B"
    assert (cfg.training.local_batch_size, cfg.training.seq_len) == (8, 8192)
    assert cfg.activation_checkpoint.mode == "full"
    parts = fc.torchtitan_stage_modules(cfg, 64)
    assert len(parts) == 8  # a looped schedule: 2 chunks per rank by default
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert sum(len([m for m in part if m.startswith("layers.")]) for part in parts) == 32


def test_torchtitan_explicit_stage_modules():
    bounds = [0, 7, 15, 23, 32]
    parts = [[f"layers.{i}" for i in range(a, b)] for a, b in zip(bounds, bounds[1:])]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    text = _job(f"module_fqns_per_model_part = {parts!r}".replace("'", '"')).replace(
        '"Interleaved1F1B"', '"1F1B"').replace("data_parallel_shard_degree = 2",
                                               "data_parallel_shard_degree = 1")
    cfg = fc.torchtitan_config(text, world_size=32)
    assert [len(p) for p in fc.torchtitan_stage_modules(cfg, 32)] == [8, 8, 8, 11]


_EIGHT = [["tok_embeddings", "layers.0"]] + [[f"layers.{i}"] for i in range(1, 7)] \
    + [["layers.7", "norm", "output"]]


@pytest.mark.parametrize("edits, world, error, match", [
    ({"tensor_parallel_degree = 8": "tensor_parallel_degre = 8"}, None, ValueError,
     "tensor_parallel_degre"),
    ({"[training]": "[trainin]"}, None, ValueError, "trainin"),
    ({"tensor_parallel_degree = 8": "tensor_parallel_degree = 3"}, 64, AssertionError,
     "Invalid parallel dims"),
    ({'"Interleaved1F1B"': '"Bogus"'}, 64, ValueError, "Unknown schedule"),
    ({'"Interleaved1F1B"': '"1F1B"', "microbatch_size = 1\n": "microbatch_size = 1\n"
      f"module_fqns_per_model_part = {_EIGHT!r}\n".replace("'", '"')}, 64, ValueError,
     "one chunk per rank"),
    ({"pipeline_parallel_microbatch_size = 1": "pipeline_parallel_microbatch_size = 3"}, 64,
     ValueError, "divisible"),
])
def test_torchtitan_rejects(edits, world, error, match):
    """Unknown sections and fields, and what torchtitan's start-up checks refuse (0.2.2's
    parser takes a TOML value of the wrong type with a warning: not checked)."""
    text = _job()
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    with pytest.raises(error, match=match):
        fc.torchtitan_config(text, world_size=world)


# --------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------

DS = {
    "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
    "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
    "pipeline": {"stages": 2, "partition": "uniform", "activation_checkpoint_interval": 1},
}


def test_deepspeed_accepts_pipeline_config():
    cfg = fc.deepspeed_config(DS, world_size=16, pipeline_parallel_size=2)
    assert cfg.world_size == 8  # data-parallel ranks: 16 / pp 2
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (256, 4, 8)
    assert cfg.zero_optimization_stage == 1
    assert cfg.bfloat16_config.enabled and not cfg.float16_config.enabled
    assert cfg.pipeline["stages"] == 2 and cfg.pipeline["activation_checkpoint_interval"] == 1
    assert not torch.distributed.is_initialized()  # its one-rank group is gone


def test_deepspeed_fills_in_accumulation():
    config = {k: v for k, v in DS.items() if k != "gradient_accumulation_steps"}
    assert fc.deepspeed_config(config, world_size=16, pipeline_parallel_size=2).gradient_accumulation_steps == 8


@pytest.mark.parametrize("config, pp, error, match", [
    (DS, 1, AssertionError, "256 != 4 \\* 8 \\* 16"),  # without pp all 16 ranks are data-parallel
    ({**DS, "zero_optimization": {"stage": 4}}, 2, ValueError, "stage"),
    ({**DS, "zero_optimization": {"stage": 1, "bogus": 1}}, 2, ValueError, "Extra inputs"),
    ({**DS, "fp16": {"enabled": True}}, 2, AssertionError, "cannot be simultaneously"),
])
def test_deepspeed_rejects(config, pp, error, match):
    with pytest.raises(error, match=match):
        fc.deepspeed_config(config, world_size=16, pipeline_parallel_size=pp)
