"""Megatron-LM's parallel-layout rules (tests/megatron_validate.py, a copy of validate_args at
tag core_v0.16.1), rule by rule, and on the configurations autopar emits.

Every ported assert/raise has a row in RULES: flags it passes, and flags that break it and
fail with the tag's exception and message text. Those texts are written out here from the
tag's source, not computed. A few rules cannot be broken, because an earlier rule always
fires first or the check is true by construction. Their rows say which. Derived values
(DERIVED) and, for autopar's megatron target, the emitted configurations follow: 40 random
plans, test_framework_startup.py's hand-built Megatron plans and the example reports' plans.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import autopar
import framework_startup as fs
import megatron_validate as mv
from autopar.frameworks import emit, model_problem, outside_target
from autopar.contract.plan import Plan
from autopar.contract.support import plan_grad_dtype
from helpers import TINY_BATCH, TINY_SEQ, tiny_meta_gpt

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[2]
HOPPER = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # what Megatron-LM's example scripts export
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
         "--max-position-embeddings", "128", "--seq-length", "128"]


def A(*extra: str, drop: tuple[str, ...] = ()) -> list[str]:
    """MODEL and ``--micro-batch-size 1`` without the flags in ``drop`` (with their value),
    then ``extra`` (a repeated flag: argparse keeps the last)."""
    base, out, i = MODEL + ["--micro-batch-size", "1"], [], 0
    while i < len(base):
        if base[i] in drop:
            i += 2
            continue
        out.append(base[i])
        i += 1
    return out + list(extra)


class Rule(NamedTuple):
    """One ported rule: ``where`` is "<file> L<n>" as the module's comment cites it; ``good``
    passes, ``bad`` raises ``error`` with ``message`` (both on ``world`` ranks in ``env``).
    ``shadowed``: the earlier rule that ``bad`` hits first, when no flags reach this one;
    ``bad`` None: true by construction (``message`` says why)."""

    where: str
    good: list[str]
    bad: list[str] | None
    error: type[BaseException]
    message: str
    world: int = 8
    env: dict | None = None  # HOPPER unless given
    bad_env: dict | None = None  # env unless given
    bad_world: int | None = None  # world unless given
    patch: str | None = None  # megatron.core.utils function made to return False for bad
    shadowed: str | None = None


FSDP2 = ("--use-torch-fsdp2", "--no-gradient-accumulation-fusion",
         "--untie-embeddings-and-output-weights")
MFSDP = ("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor")
# GRPO defaults: 32 prompts x 2 samples x 2 iterations = 128 samples, 16 global batches of 8.
# arguments.py L373 runs before the global batch's default (L497): without the flag, TypeError.
RL = ("--perform-rl-step", "--global-batch-size", "8")
OGP = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
OGP_STEP = OGP + ("--overlap-param-gather-with-optimizer-step", "--pipeline-model-parallel-size",
                  "2", "--num-virtual-stages-per-pipeline-rank", "2", "--ckpt-format", "torch")
HYBRID = ("--hybrid-context-parallel", "--calculate-per-token-loss")
NOT_ENV = {}  # FSDP needs CUDA_DEVICE_MAX_CONNECTIONS other than 1

AP = "arguments.py"
RULES = [
    Rule(f"{AP} L310", A("--use-legacy-models", "--ckpt-format", "torch"),
         A("--use-legacy-models"), AssertionError,
         "legacy model format only supports the 'torch' checkpoint format."),
    Rule(f"{AP} L317", A("--tensor-model-parallel-size", "4"),
         A("--tensor-model-parallel-size", "4"), AssertionError,
         "world size (6) is not divisible by total_model_size (total_model_size=4)", bad_world=6),
    Rule(f"{AP} L322", A("--attention-backend", "local", "--spec", "local"),
         A("--attention-backend", "local", "--spec", "megatron.core.models.gpt", "spec"),
         AssertionError, "--attention-backend local is only supported with --spec local"),
    Rule(f"{AP} L360", A(*RL, "--rl-inference-expert-model-parallel-size", "2"),
         A(*RL, "--rl-inference-expert-model-parallel-size", "2", "--moe-use-legacy-grouped-gemm"),
         AssertionError,
         "Legacy GroupedMLP (--moe-use-legacy-grouped-gemm) is not supported when using "
         "different expert parallelism sizes for inference and training. Use SequentialMLP "
         "(default when --moe-grouped-gemm is not set) or TEGroupedMLP (--moe-grouped-gemm "
         "without --moe-use-legacy-grouped-gemm)."),
    Rule(f"{AP} L373", A(*RL, "--global-batch-size", "16"), A(*RL, "--global-batch-size", "24"),
         AssertionError,
         "grpo_group_size * grpo_prompts_per_step * grpo_iterations should be divisible by "
         "global_batch_size"),
    Rule(f"{AP} L381", A(*RL, "--exit-interval", "32"), A(*RL, "--exit-interval", "10"),
         AssertionError,
         "exit_interval should be divisible by number of global batches per inference iteration."),
    Rule(f"{AP} L384", A(*RL, "--save-interval", "16"), A(*RL, "--persistent-save-interval", "20"),
         AssertionError,
         "save_interval should be divisible by number of global batches per inference iteration."),
    Rule(f"{AP} L387", A(*RL, "--rl-use-sequence-packing"),
         A(*RL, "--rl-use-sequence-packing", "--micro-batch-size", "2"), AssertionError,
         "micro_batch_size must be 1 when using sequence packing. To increase compute per "
         "micro batch increase the sequence length."),
    Rule(f"{AP} L405", A("--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2"),
         A("--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "2"),
         AssertionError, ""),
    Rule(f"{AP} L407", A("--cp-comm-type", "a2a+p2p", "--context-parallel-size", "2",
                         "--hierarchical-context-parallel-sizes", "2"),
         A("--cp-comm-type", "a2a+p2p"), AssertionError,
         "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm"),
    Rule(f"{AP} L414", A(), A("--batch-size", "4"), AssertionError,
         "--batch-size argument is no longer valid, use --micro-batch-size instead"),
    Rule(f"{AP} L420", A("--tensor-model-parallel-size", "2"), A("--model-parallel-size", "2"),
         AssertionError,
         "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead"),
    Rule(f"{AP} L427", A("--recompute-activations"), A("--checkpoint-activations"), SystemExit,
         "None"),  # exit() after printing (test_checkpoint_activations_prints_and_exits)
    Rule(f"{AP} L435", A("--enable-cuda-graph"), A("--enable-cuda-graph", "--cuda-graph-impl", "local"),
         AssertionError,
         "Do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl."),
    Rule(f"{AP} L438", A("--external-cuda-graph"), A("--enable-cuda-graph", "--external-cuda-graph"),
         AssertionError,
         "--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time."),
    Rule(f"{AP} L492", A("--phase-transition-iterations", "10,5"),
         A("--phase-transition-iterations", "10,5", "--rampup-batch-size", "2", "2", "100"),
         AssertionError, "multi-phase training does not support batch size ramp-up"),
    Rule(f"{AP} L495", A(), A(drop=("--micro-batch-size",)), AssertionError, ""),
    Rule(f"{AP} L496", A(), A("--micro-batch-size", "0"), AssertionError, ""),
    Rule(f"{AP} L500", A("--global-batch-size", "8"), A("--global-batch-size", "0"),
         AssertionError, ""),
    Rule(f"{AP} L503", A("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"),
         A("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
           "--num-layers-per-virtual-pipeline-stage", "1"), AssertionError,
         "No more than one of the following arguments can be set at the same time: "
         "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank,"
         "--pipeline-model-parallel-layout. args.num_layers_per_virtual_pipeline_stage=1, "
         "args.num_virtual_stages_per_pipeline_rank=2, args.pipeline_model_parallel_layout=None."),
    Rule(f"{AP} L520", A("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tttttL"),
         A("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tt|tttL"),
         AssertionError,
         "The length of pipeline_model_parallel_layout must be divisible by "
         "pipeline_model_parallel_size (num_stages=3, args.pipeline_model_parallel_size=2)"),
    Rule(f"{AP} L530", A("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"),
         A("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
           "--decoder-first-pipeline-num-layers", "2"), AssertionError,
         "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel "
         "degree when enable uneven pipeline parallelism"),
    Rule(f"{AP} L543", A("--pipeline-model-parallel-size", "3", "--num-layers-per-virtual-pipeline-stage",
                         "1", "--account-for-embedding-in-pipeline-split"),  # 8 + 1 layers
         A("--pipeline-model-parallel-size", "3", "--num-layers-per-virtual-pipeline-stage", "1"),
         AssertionError,
         "number of layers of the model must be divisible pipeline model parallel size", world=6),
    Rule(f"{AP} L547", A("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"),
         A("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"),
         AssertionError,
         "number of layers per pipeline stage must be divisible number of layers per virtual "
         "pipeline stage"),
    Rule(f"{AP} L570", A("--pipeline-model-parallel-size", "3", "--account-for-loss-in-pipeline-split"),
         A("--pipeline-model-parallel-size", "3"), AssertionError,
         "Number of layers should be divisible by the pipeline-model-parallel size", world=6),
    Rule(f"{AP} L575", A("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"),
         A("--num-virtual-stages-per-pipeline-rank", "2"), AssertionError,
         "When interleaved schedule is used, pipeline-model-parallel size should be greater "
         "than 1"),
    Rule(f"{AP} L579", A("--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank",
                         "2", "--no-overlap-p2p-communication"),
         A("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
           "--no-overlap-p2p-communication"), AssertionError,
         "When interleaved schedule is used and p2p communication overlap is disabled, "
         "pipeline-model-parallel size should be greater than 2 to avoid having multiple p2p "
         "sends and recvs between same 2 ranks per communication batch"),
    Rule(f"{AP} L598", A(*OGP), A("--overlap-grad-reduce", "--overlap-param-gather"),
         AssertionError,
         "--overlap-param-gather only supported with distributed optimizer or megatron fsdp"),
    Rule(f"{AP} L600", A(*OGP), A("--use-distributed-optimizer", "--overlap-param-gather"),
         AssertionError, "Must use --overlap-param-gather with --overlap-grad-reduce"),
    Rule(f"{AP} L602", A(*OGP, "--ckpt-format", "torch"),
         A(*OGP, "--ckpt-format", "torch", "--use-legacy-models"), AssertionError,
         "--overlap-param-gather only supported with MCore models"),
    Rule(f"{AP} L606", A(*FSDP2), A(*FSDP2), AssertionError,
         "FSDP2 requires PyTorch >= 2.4.0 with FSDP 2 support.", env=NOT_ENV,
         patch="is_torch_min_version"),
    Rule(f"{AP} L608", A(*FSDP2), A(*FSDP2, "--pipeline-model-parallel-size", "2"),
         AssertionError, "--use-torch-fsdp2 is not supported with pipeline parallelism",
         env=NOT_ENV),
    Rule(f"{AP} L610", A(*FSDP2), A(*FSDP2, "--expert-model-parallel-size", "2", "--num-experts", "2"),
         AssertionError, "--use-torch-fsdp2 is not supported with expert parallelism", env=NOT_ENV),
    Rule(f"{AP} L612", A(*FSDP2), A(*FSDP2, "--use-distributed-optimizer"), AssertionError,
         "--use-torch-fsdp2 is not supported with MCore's distributed optimizer", env=NOT_ENV),
    Rule(f"{AP} L614", A(*FSDP2), A(*FSDP2[::2]), AssertionError,
         "--use-torch-fsdp2 is not supported with gradient accumulation fusion", env=NOT_ENV),
    Rule(f"{AP} L616", A(*FSDP2, "--ckpt-format", "torch_dcp"), A(*FSDP2, "--ckpt-format", "torch"),
         AssertionError, "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp",
         env=NOT_ENV),
    Rule(f"{AP} L618", A(*FSDP2), A(*FSDP2[:2]), AssertionError,
         "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights", env=NOT_ENV),
    Rule(f"{AP} L620", A(*FSDP2, "--bf16"), A(*FSDP2, "--fp16"), AssertionError,
         "--use-torch-fsdp2 not supported with fp16 yet", env=NOT_ENV),
    Rule(f"{AP} L622", A(*FSDP2), A(*FSDP2), AssertionError,
         "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one",
         env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, bad_env=HOPPER),
    Rule(f"{AP} L636", A(*OGP_STEP), A("--overlap-param-gather-with-optimizer-step"),
         AssertionError,
         "--overlap-param-gather-with-optimizer-step only supported with distributed optimizer"),
    Rule(f"{AP} L638", A(*OGP_STEP),
         A("--use-distributed-optimizer", "--overlap-param-gather-with-optimizer-step"),
         AssertionError,
         "Must use --overlap-param-gather-with-optimizer-step with --overlap-param-gather"),
    Rule(f"{AP} L640", A(*OGP_STEP),
         A(*OGP, "--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"),
         AssertionError,
         "--overlap-param-gather-with-optimizer-step only supported with interleaved pipeline "
         "parallelism"),
    Rule(f"{AP} L642", A(*OGP_STEP), A(*OGP_STEP, "--ckpt-format", "torch_dist"), AssertionError,
         "--overlap-param-gather-with-optimizer-step not supported with distributed "
         "checkpointing yet"),
    Rule(f"{AP} L684", A(*MFSDP, "--data-parallel-sharding-strategy", "optim_grads_params"),
         A(*MFSDP, "--data-parallel-sharding-strategy", "optim_grads_params",
           "--check-weight-hash-across-dp-replicas-interval", "10"), AssertionError,
         "check_weight_hash_across_dp_replicas_interval is not supported with optim_grads_params",
         env=NOT_ENV),
    Rule(f"{AP} L687", A(*MFSDP), A(*MFSDP), AssertionError,
         "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one",
         env=NOT_ENV, bad_env=HOPPER),
    Rule(f"{AP} L690", A(*MFSDP), A("--use-megatron-fsdp"), AssertionError,
         "Megatron FSDP only supports fsdp_dtensor checkpoint format", env=NOT_ENV),
    Rule(f"{AP} L694", A(*MFSDP, "--fsdp-manual-registration", "--use-nccl-ub"),
         A("--fsdp-manual-registration", "--use-nccl-ub"), AssertionError,
         "FSDP manual registration is only supported with Megatron FSDP", env=NOT_ENV),
    Rule(f"{AP} L695", A(*MFSDP, "--fsdp-manual-registration", "--use-nccl-ub"),
         A(*MFSDP, "--fsdp-manual-registration"), AssertionError,
         "FSDP manual registration is only supported with nccl-ub option", env=NOT_ENV),
    Rule(f"{AP} L703", A("--fp16"), A("--fp16", "--bf16"), AssertionError, ""),
    Rule(f"{AP} L712", A("--bf16"), A("--bf16", "--fp16"), AssertionError, "",
         shadowed=f"{AP} L703"),  # --fp16 is checked first
    Rule(f"{AP} L717", A("--bf16", "--accumulate-allreduce-grads-in-fp32"),
         A("--bf16", "--accumulate-allreduce-grads-in-fp32", "--main-grads-dtype", "bf16"),
         AssertionError,
         "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set"),
    Rule(f"{AP} L765", A("--train-iters", "100"),
         A("--train-iters", "100", "--rampup-batch-size", "2", "2", "100"), AssertionError,
         "expected no batch-size rampup for iteration-based training"),
    Rule(f"{AP} L787", A(), A("--encoder-num-layers", "8"), AssertionError,
         "cannot have both num-layers and encoder-num-layers specified"),
    Rule(f"{AP} L791", A("--encoder-num-layers", "8", drop=("--num-layers",)),
         A(drop=("--num-layers",)), AssertionError,
         "either num-layers or encoder-num-layers should be specified"),
    Rule(f"{AP} L799", A(), A(drop=("--max-position-embeddings",)), AssertionError,
         "max_position_embeddings argument is None"),
    Rule(f"{AP} L814", A("--hidden-size", "65", "--kv-channels", "8"), A("--hidden-size", "65"),
         AssertionError, ""),
    Rule(f"{AP} L818", A("--context-parallel-size", "2"),
         A("--context-parallel-size", "2", "--seq-length", "130", "--max-position-embeddings", "256"),
         AssertionError,
         "seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1."),
    Rule(f"{AP} L823", A(), A("--encoder-seq-length", "128"), AssertionError, ""),
    Rule(f"{AP} L826", A("--encoder-seq-length", "128", drop=("--seq-length",)),
         A(drop=("--seq-length",)), AssertionError, ""),
    Rule(f"{AP} L830", A("--seq-length", "64"), A("--seq-length", "256"), AssertionError,
         "max_position_embeddings (128) must be greater than or equal to seq_length (256)."),
    Rule(f"{AP} L834", A("--decoder-seq-length", "128"), A("--decoder-seq-length", "256"),
         AssertionError, ""),
    Rule(f"{AP} L885", A("--tensor-model-parallel-size", "2", "--distribute-saved-activations",
                         "--recompute-granularity", "full", "--recompute-method", "uniform"),
         A("--distribute-saved-activations", "--recompute-granularity", "full",
           "--recompute-method", "uniform"), AssertionError,
         "can distribute recomputed activations only across tensor model parallel groups"),
    Rule(f"{AP} L888", A("--tensor-model-parallel-size", "2", "--distribute-saved-activations",
                         "--recompute-granularity", "full", "--recompute-method", "block"),
         A("--tensor-model-parallel-size", "2", "--distribute-saved-activations"), AssertionError,
         "distributed recompute activations is only application to full recompute granularity"),
    Rule(f"{AP} L891", A("--tensor-model-parallel-size", "2", "--distribute-saved-activations",
                         "--recompute-granularity", "full", "--recompute-method", "block"),
         A("--tensor-model-parallel-size", "2", "--distribute-saved-activations",
           "--recompute-granularity", "full"), AssertionError,
         "for distributed recompute activations to work you need to use a recompute method "),
    Rule(f"{AP} L894", A("--tensor-model-parallel-size", "2", "--distribute-saved-activations",
                         "--recompute-granularity", "full", "--recompute-method", "block"),
         A("--tensor-model-parallel-size", "2", "--distribute-saved-activations",
           "--recompute-granularity", "full", "--recompute-method", "block"), AssertionError,
         "distributed recompute activations are supported for pytorch v1.10 and above (Nvidia "
         f"Pytorch container >= 21.07). Current pytorch version is v{torch.__version__}.",
         patch="is_torch_min_version"),
    Rule(f"{AP} L900", A("--recompute-granularity", "selective"),
         A("--recompute-granularity", "selective", "--recompute-method", "uniform"), AssertionError,
         "recompute method is not yet supported for selective recomputing granularity"),
    Rule(f"{AP} L916", A("--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"),
         A("--sequence-parallel", "--tp-comm-overlap"), AssertionError,  # dropped at tp = 1
         "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism "
         "is enabled"),
    Rule(f"{AP} L919", A(*HYBRID), A(*HYBRID, "--pipeline-model-parallel-size", "2"),
         AssertionError, "Hybrid context parallelism not supported with pipeline parallelism"),
    # L434-447 delete args.enable_cuda_graph once set, so L920 raises AttributeError in the tag
    Rule(f"{AP} L920", A(*HYBRID), A(*HYBRID, "--enable-cuda-graph"), AttributeError,
         "'Namespace' object has no attribute 'enable_cuda_graph'"),
    Rule(f"{AP} L921", A(*HYBRID), A(*HYBRID, *MFSDP), AssertionError,
         "Hybrid context parallelism not supported with Megatron FSDP", env=NOT_ENV),
    Rule(f"{AP} L922", A(*HYBRID, "--dataloader-type", "single"),
         A(*HYBRID, "--dataloader-type", "cyclic"), AssertionError,
         "Hybrid context parallelism only supported with single dataloader type"),
    Rule(f"{AP} L923", A(*HYBRID), A("--hybrid-context-parallel"), AssertionError,
         "Hybrid context parallelism must be used with --calculate-per-token-loss"),
    Rule(f"{AP} L951", A("--tensor-model-parallel-size", "2"), A("--context-parallel-size", "2"),
         AssertionError,
         "Using tensor model parallelism or context parallelism require setting the environment "
         "variable CUDA_DEVICE_MAX_CONNECTIONS to 1", bad_env={}),
    Rule(f"{AP} L1010", A("--position-embedding-type", "mrope", "--mrope-section", "1", "2"),
         A("--position-embedding-type", "mrope"), AssertionError,
         "--mrope-section should be set when using --position-embedding-type mrope."),
    Rule(f"{AP} L1022", A("--context-parallel-size", "2"),
         A("--context-parallel-size", "2", "--use-legacy-models", "--ckpt-format", "torch"),
         AssertionError, "Context parallelism is not supported in legacy models."),
    Rule(f"{AP} L1026", A("--expert-model-parallel-size", "2", "--num-experts", "2"),
         A("--expert-model-parallel-size", "2"), AssertionError,
         "num_experts must be non None to use expert model parallelism"),
    Rule(f"{AP} L1027", A("--expert-model-parallel-size", "4", "--num-experts", "8"),
         A("--expert-model-parallel-size", "4", "--num-experts", "6"), AssertionError,
         "Number of experts should be a multiple of expert model parallel_size."),
    Rule(f"{AP} L1042", A(*FSDP2, "--ckpt-format", "torch_dcp"), A("--ckpt-format", "torch_dcp"),
         AssertionError, "--ckpt-format torch_dcp is only tested with FSDP.", env=NOT_ENV),
    Rule(f"{AP} L1043", A(*FSDP2, "--ckpt-format", "torch_dcp"),
         A(*FSDP2, "--ckpt-format", "torch_dcp", "--tensor-model-parallel-size", "2"),
         AssertionError, "--ckpt-format torch_dcp is not tested with megatron tensor parallelism.",
         env=NOT_ENV),
    Rule(f"{AP} L1045", A(*FSDP2, "--ckpt-format", "torch_dcp"),
         A(*FSDP2, "--ckpt-format", "torch_dcp", "--pipeline-model-parallel-size", "2"),
         AssertionError, "--use-torch-fsdp2 is not supported with pipeline parallelism",
         env=NOT_ENV, shadowed=f"{AP} L608"),  # torch_dcp needs FSDP2, FSDP2 needs pp = 1
    Rule(f"{AP} L1050", A(*MFSDP), A("--ckpt-format", "fsdp_dtensor"), AssertionError,
         "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP.", env=NOT_ENV),
    Rule(f"{AP} L1100", A("--disable-gloo-process-groups", "--use-distributed-optimizer"),
         A("--disable-gloo-process-groups", "--use-distributed-optimizer", "--ckpt-format", "torch"),
         AssertionError, ""),
    Rule(f"{AP} L1103", A("--disable-gloo-process-groups", "--use-distributed-optimizer",
                          "--dist-ckpt-optim-fully-reshardable"),
         A("--disable-gloo-process-groups", "--use-distributed-optimizer",
           "--dist-ckpt-optim-fully-reshardable", "--distrib-optim-fully-reshardable-mem-efficient"),
         AssertionError,
         "--distrib-optim-fully-reshardable-mem-efficient requires -enable-gloo-process-groups"),
    Rule(f"{AP} L1148", A("--inference-batch-times-seqlen-threshold", "16",
                          "--pipeline-model-parallel-size", "2"),
         A("--inference-batch-times-seqlen-threshold", "16"), AssertionError,
         "--inference-batch-times-seqlen-threshold requires setting "
         "--pipeline-model-parallel-size > 1."),
    Rule(f"{AP} L1150", A("--inference-batch-times-seqlen-threshold", "16",
                          "--pipeline-model-parallel-size", "2"),
         A("--inference-batch-times-seqlen-threshold", "16", "--pipeline-model-parallel-size", "2",
           "--enable-cuda-graph"), AssertionError,  # L446: --enable-cuda-graph means local
         "Pipeline-parallel microbatched inference is incompatible with CUDA graphs"),
    Rule(f"{AP} L1159", A("--cuda-graph-impl", "local", "--expert-model-parallel-size", "2",
                          "--num-experts", "2", "--moe-pad-experts-for-cuda-graph-inference"),
         A("--cuda-graph-impl", "local", "--expert-model-parallel-size", "2", "--num-experts", "2"),
         AssertionError,
         "--moe-pad-experts-for-cuda-graph-inference must be set when using CUDA graphs with "
         "expert parallelism"),
    Rule(f"{AP} L1181", A("--optimizer", "muon"), A("--optimizer", "muon", "--overlap-grad-reduce"),
         AssertionError, "Muon optimizer does not support overlap grad reduce for now."),
    Rule(f"{AP} L1182", A("--optimizer", "dist_muon"), A("--optimizer", "muon", *OGP),
         AssertionError, "Muon optimizer does not support overlap grad reduce for now.",
         shadowed=f"{AP} L1181"),  # L600: param gather needs grad reduce, refused first
    Rule(f"{AP} L1184", A("--optimizer", "muon"), A("--optimizer", "muon", "--use-distributed-optimizer"),
         AssertionError, "Muon optimizer does not support distributed optimizer for now."),
    Rule(f"{AP} L1185", A("--optimizer", "muon"), A("--optimizer", "muon", *FSDP2), AssertionError,
         "Muon optimizer does not support Torch-FSDP2 for now.", env=NOT_ENV),
    Rule(f"{AP} L1186", A("--optimizer", "muon"), A("--optimizer", "muon", *MFSDP), AssertionError,
         "Muon optimizer does not support Megatron-FSDP for now.", env=NOT_ENV),
    Rule(f"{AP} L1187", A("--optimizer", "muon", "--ckpt-format", "torch"),
         A("--optimizer", "muon", *FSDP2, "--ckpt-format", "torch_dcp"), AssertionError,
         "Muon optimizer does not support Torch-FSDP2 for now.", env=NOT_ENV,
         shadowed=f"{AP} L1185"),  # torch_dcp needs FSDP2 (L1042), fsdp_dtensor Megatron-FSDP
    Rule(f"{AP} L1248", A("--cuda-graph-impl", "transformer_engine"),
         A("--external-cuda-graph"), AssertionError,  # L453: transformer_engine
         "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph with "
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
         env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_GRAPH_REGISTER": "0"},
         bad_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    Rule(f"{AP} L1266", A("--multi-latent-attention"),
         A("--multi-latent-attention", "--group-query-attention"), AssertionError,
         "Group query attention is mutually exclusive with multi latent attention."),
    # megatron-core's constant micro-batch calculator (global_vars.py L93-100)
    Rule("num_microbatches_calculator.py L329", A("--decrease-batch-size-if-needed",
                                                  "--global-batch-size", "12"), None,
         AssertionError, "true by construction: the batch was just rounded down to a multiple"),
    Rule("num_microbatches_calculator.py L340", A("--global-batch-size", "16"),
         A("--global-batch-size", "12"), AssertionError,
         "global batch size (12) is not divisible by micro batch size (1) times data parallel "
         "size (8)"),
    Rule("num_microbatches_calculator.py L348", A("--decrease-batch-size-if-needed",
                                                  "--global-batch-size", "8"),
         A("--decrease-batch-size-if-needed", "--global-batch-size", "4"), AssertionError,
         "number of microbatches should be at least 1, got 0."),
    # megatron-core's initialize_model_parallel (initialize.py L364-385)
    Rule("parallel_state.py L792", A("--expert-model-parallel-size", "4", "--num-experts", "4"),
         A("--expert-model-parallel-size", "3", "--num-experts", "3"), RuntimeError,
         "world_size (8) is not divisible by expert_tensor_model_pipeline_parallel size (3)"),
    Rule("parallel_state.py L808", A("--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2"),
         A("--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2",
           "--expert-model-parallel-size", "2", "--num-experts", "2"), AssertionError,
         "When not using pp-last rank ordering, the data parallel size of the attention and moe "
         "layers must be the same"),
    Rule("parallel_state.py L814", A("--use-tp-pp-dp-mapping", "--tensor-model-parallel-size", "2",
                                     "--pipeline-model-parallel-size", "2",
                                     "--expert-model-parallel-size", "2", "--num-experts", "2",
                                     "--expert-tensor-parallel-size", "1"),
         None, AssertionError,
         "true after L808: the pipeline groups of two orders differ only when the ranks inside a "
         "pipeline stage do, i.e. when the data-parallel sizes differ with pp not last "
         "(test_pipeline_groups_match_whenever_the_data_parallel_rule_holds)"),
    Rule("parallel_state.py L833", A("--num-distributed-optimizer-instances", "2"),
         A("--num-distributed-optimizer-instances", "3"), AssertionError,
         "Data parallel size should be divisible by partial DistOpt shard factor"),
    Rule("parallel_state.py L941", A(*HYBRID), A(*HYBRID), AssertionError,
         "Hybrid context parallel requires an even number of ranks", bad_world=3),
]


def _validate(argv, world, env, arch=9):
    return mv.validate_layout_args(argv, world, environ=HOPPER if env is None else env,
                                   device_arch=arch)


@pytest.mark.parametrize("rule", RULES, ids=[r.where for r in RULES])
def test_rule_passes_and_fails_with_the_tags_message(rule, monkeypatch):
    """``good`` passes every ported rule; ``bad`` raises the tag's exception and message text
    (for a shadowed rule, the earlier rule's)."""
    _validate(rule.good, rule.world, rule.env)
    if rule.bad is None:
        return
    if rule.patch:
        import megatron.core.utils

        monkeypatch.setattr(megatron.core.utils, rule.patch, lambda *a, **k: False)
    with pytest.raises(rule.error) as raised:
        _validate(rule.bad, rule.bad_world or rule.world,
                  rule.env if rule.bad_env is None else rule.bad_env)
    assert type(raised.value) is rule.error
    assert str(raised.value) == rule.message


def _cited_rules() -> dict[str, int]:
    """"<file> L<n>" of each assert/raise in tests/megatron_validate.py (the first line
    comment inside the statement), with how many statements cite it."""
    path = Path(mv.__file__)
    text = path.read_text()
    lines = text.splitlines()
    cited: dict[str, int] = {}
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.Assert, ast.Raise)):
            continue
        span = " ".join(lines[node.lineno - 1:node.end_lineno])
        found = re.search(r"# (arguments\.py|parallel_state\.py|num_microbatches_calculator\.py) "
                          r"L(\d+)", span)
        if found is None:  # the only uncited raise: a flag this module does not declare
            assert "does not know" in span, span
            continue
        where = f"{found.group(1)} L{found.group(2)}"
        cited[where] = cited.get(where, 0) + 1
    return cited


def test_every_ported_rule_has_a_row():
    """RULES holds each ported assert/raise exactly once, and nothing else; only the rules
    no flags can break go without a failing case of their own."""
    cited = _cited_rules()
    assert all(n == 1 for n in cited.values()), cited
    assert sorted(cited) == sorted(r.where for r in RULES)
    unbreakable = sorted(r.where for r in RULES if r.bad is None or r.shadowed)
    assert unbreakable == sorted([
        "arguments.py L712", "arguments.py L1045", "arguments.py L1182", "arguments.py L1187",
        "num_microbatches_calculator.py L329", "parallel_state.py L814"])
    print(f"{len(RULES)} ported rules, {len(RULES) - len(unbreakable)} broken here")


def test_pipeline_groups_match_whenever_the_data_parallel_rule_holds():
    """parallel_state.py L814 cannot fail after L808: for both rank orders and every layout
    of up to 16 ranks that passes L792 and L808, the attention and expert pipeline groups
    (megatron-core's RankGenerator) are the same."""
    from megatron.core.parallel_state import RankGenerator

    checked = 0
    for world in range(1, 17):
        for tp in (1, 2, 4):
            for pp in (1, 2, 4):
                for cp in (1, 2):
                    for ep in (1, 2, 4):
                        for etp in (1, 2):
                            if world % (tp * pp * cp) or world % (etp * ep * pp):
                                continue
                            dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
                            for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"):
                                if not (order.endswith("pp") or pp == 1 or edp == dp):
                                    continue
                                dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
                                expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1,
                                                       order=order)
                                assert dense.get_ranks("pp") == expert.get_ranks("pp")
                                checked += 1
    assert checked > 100


def test_checkpoint_activations_prints_and_exits(capsys):
    """arguments.py L424-427: the message through print_rank_0, then ``exit()``."""
    with pytest.raises(SystemExit) as raised:
        _validate(A("--checkpoint-activations"), 8, None)
    assert raised.value.code is None
    assert capsys.readouterr().out == (
        "--checkpoint-activations is no longer valid, use --recompute-activations, or, for more "
        "control, --recompute-granularity and --recompute-method.\n")


def test_rl_batch_rule_runs_before_the_global_batch_default():
    """arguments.py L373 divides by ``global_batch_size`` before L497 gives it its default:
    ``--perform-rl-step`` without ``--global-batch-size`` is a TypeError at the tag."""
    with pytest.raises(TypeError, match="unsupported operand type"):
        _validate(A("--perform-rl-step"), 8, None)


def test_layout_is_parsed_by_megatron_cores_own_parser():
    """arguments.py L519 counts the layout's stages with megatron-core's
    ``PipelineParallelLayerLayout.get_num_stages_from_str``, which refuses unknown symbols."""
    with pytest.raises(AssertionError, match=r"^Invalid layer character: x"):
        _validate(A("--pipeline-model-parallel-size", "2",
                    "--pipeline-model-parallel-layout", "Ettx|ttttL"), 8, None)
    args = _validate(A("--pipeline-model-parallel-size", "2",
                       "--pipeline-model-parallel-layout", "E|(tt|)*3,tt|L"), 8, None)
    assert args.virtual_pipeline_model_parallel_size == 3  # 6 stages over pp = 2


# --------------------------------------------------------------------- derived values
DERIVED = [  # (flags, world, {attribute: value} after validate_layout_args)
    (A("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
       "--context-parallel-size", "2", "--expert-model-parallel-size", "4", "--num-experts", "8"), 64,
     {"data_parallel_size": 8, "global_batch_size": 8, "num_microbatches": 1,
      "expert_tensor_parallel_size": 2, "transformer_pipeline_model_parallel_size": 2}),
    (A("--global-batch-size", "64", "--micro-batch-size", "2"), 8,
     {"data_parallel_size": 8, "num_microbatches": 4}),
    (A("--global-batch-size", "20", "--decrease-batch-size-if-needed"), 8,
     {"global_batch_size": 20, "num_microbatches": 2}),  # runs 16 of the 20
    (A("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"), 8,
     {"virtual_pipeline_model_parallel_size": 2, "overlap_p2p_comm": True,
      "align_param_gather": True}),
    (A("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "4"), 8,
     {"virtual_pipeline_model_parallel_size": None, "overlap_p2p_comm": False,
      "align_param_gather": False}),  # 1 -> None: no interleaving
    (A("--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "3"), 8,
     {"virtual_pipeline_model_parallel_size": 3}),  # not checked against the 8 layers here
    (A("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Etttt|ttttL"), 8,
     {"virtual_pipeline_model_parallel_size": None}),
    (A("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"), 8,
     {"virtual_pipeline_model_parallel_size": None}),  # uneven stages: not checked here
    (A(), 8, {"params_dtype": torch.float32, "main_grads_dtype": torch.float32,
              "accumulate_allreduce_grads_in_fp32": False}),
    (A("--bf16"), 8, {"params_dtype": torch.bfloat16, "accumulate_allreduce_grads_in_fp32": True}),
    (A("--bf16", "--grad-reduce-in-bf16"), 8, {"accumulate_allreduce_grads_in_fp32": False}),
    (A("--bf16", "--main-grads-dtype", "bf16"), 8,
     {"main_grads_dtype": torch.bfloat16, "accumulate_allreduce_grads_in_fp32": False}),
    (A("--fp16"), 8, {"params_dtype": torch.float16, "accumulate_allreduce_grads_in_fp32": False}),
    (A("--sequence-parallel"), 8, {"sequence_parallel": False}),
    (A("--sequence-parallel", "--tensor-model-parallel-size", "2"), 8, {"sequence_parallel": True}),
    (A("--recompute-activations"), 8, {"recompute_granularity": "selective"}),
    (A("--swiglu"), 8, {"ffn_hidden_size": 128, "kv_channels": 8}),  # int(4*64*2/3/64)*64
    (A(), 8, {"ffn_hidden_size": 256, "encoder_num_layers": 8, "encoder_seq_length": 128,
              "dataloader_type": "single", "use_dist_ckpt": True, "cuda_graph_impl": "none",
              "high_priority_stream_groups": [], "num_experts": None, "rank": 0,
              "world_size": 8}),
    (A("--encoder-num-layers", "6", "--encoder-seq-length", "64",
       drop=("--num-layers", "--seq-length")), 8, {"num_layers": 6, "seq_length": 64}),
    (A("--num-experts", "0"), 8, {"num_experts": None, "moe_ffn_hidden_size": None}),
    (A("--num-experts", "4", "--ffn-hidden-size", "96"), 8, {"moe_ffn_hidden_size": 96}),
    (A("--enable-cuda-graph"), 8, {"cuda_graph_impl": "local"}),
    (A("--ckpt-format", "torch"), 8, {"use_dist_ckpt": False}),
    (A(*MFSDP, "--expert-model-parallel-size", "2", "--num-experts", "2"), 8,
     {"use_custom_fsdp": True, "high_priority_stream_groups": []}),  # Hopper: none added
    (A(*FSDP2, "--bf16"), 8, {"high_priority_stream_groups": ["dp_cp"]}),  # FSDP2: any arch
]


@pytest.mark.parametrize("argv, world, expected", DERIVED)
def test_derived_values_are_the_tags(argv, world, expected):
    fsdp = any(flag in argv for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp"))
    args = _validate(argv, world, NOT_ENV if fsdp else None)
    assert {name: getattr(args, name) for name in expected} == expected


def test_blackwell_needs_no_cuda_device_max_connections_and_adds_fsdp_stream_groups():
    """arguments.py L927 and L958: from arch 10 on, tp > 1 runs without
    CUDA_DEVICE_MAX_CONNECTIONS=1, and Megatron-FSDP asks for high-priority dp_cp/ep_dp."""
    args = _validate(A("--tensor-model-parallel-size", "2", *MFSDP, "--expert-model-parallel-size",
                       "2", "--num-experts", "2"), 8, NOT_ENV, arch=10)
    assert args.high_priority_stream_groups == ["dp_cp", "ep_dp"]
    _validate(A("--tensor-model-parallel-size", "2"), 8, NOT_ENV, arch=10)


def test_flags_outside_the_layout_rules_are_refused_by_name():
    with pytest.raises(ValueError, match=r"does not know: \['--fp8-param-gather'\]"):
        _validate(A("--fp8-param-gather"), 8, None)

    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        _validate(A("--recompute-granularity", "some"), 8, None)


def test_module_names_its_tag():
    assert (mv.TAG, mv.COMMIT) == ("core_v0.16.1", "55ac7082517c3878ae653c07c09c534b8aed49f6")
    assert mv.TAG in mv.__doc__ and mv.COMMIT in mv.__doc__


# --------------------------------------------------------- what autopar emits for megatron
@pytest.fixture(scope="module")
def base_plan():
    """A real plan whose layout fields the random plans replace (as test_frameworks.py's)."""
    return autopar.plan(tiny_meta_gpt(), autopar.Cluster.local_cpu(processes=2),
                        global_batch_size=TINY_BATCH, seq_len=TINY_SEQ, model_name="gpt-tiny")


def _exported(text: str) -> dict[str, str]:
    """The environment an emitted fragment's header exports (``# export NAME=VALUE``)."""
    return dict(line[len("# export "):].split("=", 1) for line in text.splitlines()
                if line.startswith("# export "))


def _emitted_passes(plan) -> None:
    """``emit(plan, "megatron")`` passes every ported rule on the plan's GPUs, in the
    environment its header exports (CUDA_DEVICE_MAX_CONNECTIONS=1 with tp > 1: arguments.py
    L951 requires it before Blackwell), on Hopper. The namespace holds the plan's degrees."""
    text = emit(plan, "megatron")
    args = mv.validate_layout_args(fs.megatron_argv(text), plan.num_gpus,
                                   environ=_exported(text), device_arch=9)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size) == (plan.tp, plan.pp, plan.dp)
    assert args.virtual_pipeline_model_parallel_size == (
        None if plan.virtual_stages == 1 else plan.virtual_stages)
    assert (args.micro_batch_size, args.global_batch_size, args.num_microbatches) == (
        plan.micro_batch_size, plan.global_batch_size, plan.num_micro_batches)
    assert args.sequence_parallel == plan.sequence_parallel
    assert args.use_distributed_optimizer == (plan.zero_stage == 1)
    assert args.accumulate_allreduce_grads_in_fp32 == (
        plan.dtype == "bf16" and plan_grad_dtype(plan) == "fp32")


def test_random_megatron_plans_pass_the_tags_layout_rules(base_plan):
    """40 random plans inside autopar's megatron target (test_frameworks.target_plans)."""
    from hypothesis import HealthCheck, given, settings
    from test_frameworks import target_plans

    checked = []

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(target_plans(base_plan, "megatron"))
    def check(plan):
        assert outside_target(plan, "megatron") is None
        _emitted_passes(plan)
        checked.append(plan)

    check()
    assert len(checked) == 40
    print(f"40 random megatron plans pass, world sizes {sorted({p.num_gpus for p in checked})}, "
          f"interleaved: {sum(p.virtual_stages > 1 for p in checked)}")


HAND_BUILT = ["tp-pp-distopt", "interleaved-bf16-grads", "tp4-fp32", "llama-gqa-uneven-block",
              "interleaved-pp2"]


@pytest.mark.parametrize("name", HAND_BUILT)
def test_hand_built_megatron_plans_pass_the_tags_layout_rules(base_plan, name):
    """test_framework_startup.py's Megatron plans (interleaved, an uneven layout with block
    recompute, tp 4 in fp32), and interleaving over pp = 2 (arguments.py L575: allowed with
    Megatron-LM's default p2p overlap)."""
    from test_framework_startup import MEGATRON, _gpt, _plan

    config, layout = MEGATRON.get(name) or (_gpt(8), dict(
        pp=2, dp=2, mbs=1, m=4, v=2, schedule="interleaved_1f1b", recompute="selective"))
    _emitted_passes(_plan(base_plan, "megatron", config, **layout))


def test_example_report_plans_pass_the_tags_layout_rules():
    """Every reports/*/plan*.json inside the megatron target (model and layout)."""
    passed = 0
    for path in sorted((REPO / "reports").glob("*/plan*.json")):
        plan = Plan.from_json(path.read_text(), str(path))
        if model_problem(plan.model_config, "megatron") is None and \
                outside_target(plan, "megatron") is None:
            _emitted_passes(plan)
            passed += 1
    assert passed >= 6, passed


def test_emitted_tensor_parallel_plans_export_cuda_device_max_connections():
    """The flags alone do not make a runnable launch on A100/H100 once tp > 1: the
    environment must hold CUDA_DEVICE_MAX_CONNECTIONS=1 (arguments.py L927-952), or
    validate_args stops (from Blackwell, arch 10, on it need not), so the emitted header
    exports it."""
    plan = Plan.from_json((REPO / "reports/gpt3-175b-dgx-a100-128/plan-megatron.json").read_text())
    assert plan.tp > 1
    text = emit(plan, "megatron")
    assert _exported(text) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    argv = fs.megatron_argv(text)
    mv.validate_layout_args(argv, plan.num_gpus, environ=_exported(text), device_arch=8)
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS to 1$"):
        mv.validate_layout_args(argv, plan.num_gpus, environ={}, device_arch=8)
    mv.validate_layout_args(argv, plan.num_gpus, environ={}, device_arch=10)
