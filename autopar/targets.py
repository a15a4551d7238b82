"""What each training framework can execute: the targets ``autopar.plan(..., target=)``
searches inside.

A *target* is the space of plans one runner executes, as a
:class:`~autopar.contract.support.RuntimeSupport`; ``autopar.plan(..., target=)`` searches only
inside it, so the plan a user takes to Megatron-LM is the best plan Megatron-LM can run,
priced by the same cost model:

* ``autopar``: the autopar runtime (:data:`~autopar.contract.support.RUNTIME_SUPPORT`).
* ``megatron`` (Megatron-LM / megatron-core): Megatron's tensor-parallel pattern
  (column-parallel QKV and MLP-in, row-parallel attention-out and MLP-out,
  vocabulary-parallel embedding and head; Shoeybi et al. 2019, section 3), 1F1B or
  interleaved 1F1B (``--num-layers-per-virtual-pipeline-stage``), uneven stages
  (``--pipeline-model-parallel-layout``), recompute as one granularity: full on the first k
  layers of every stage (``--recompute-method block --recompute-num-layers k``) or selective
  everywhere; under interleaving one mode for all layers; ZeRO-1 as the distributed
  optimizer (``--use-distributed-optimizer``), no ZeRO-2/3; sequence parallelism free;
  bf16 gradients (``--grad-reduce-in-bf16``, planned) or its default fp32 main gradients
  reduced in fp32 (``accumulate_allreduce_grads_in_fp32``, read from a script without it);
  a Mixtral-family MoE model at tp = 1, or at tp > 1 with ep > 1 and sequence
  parallelism, expert parallelism folded over TP×DP (``--expert-model-parallel-size``,
  expert-TP 1, alltoall dispatch: :mod:`autopar.frameworks.megatron_moe`);
  attention as the cluster says in bf16, emitted as ``--attention-backend flash`` or
  ``unfused`` (Transformer Engine's kernel that keeps the softmax), unfused in fp32 (TE's
  flash and cuDNN kernels take 16-bit inputs only; its default ``auto`` picks one of them
  in bf16, so a script without the flag is read as flash).
* ``torchtitan``: Megatron's pattern through its Llama TP plan, which always runs norms on
  sequence shards (sequence parallelism on at tp > 1), GPipe, 1F1B or interleaved 1F1B with
  any stage split (``module_fqns_per_model_part``), activation checkpointing "none" or "full"
  on every layer (its "selective" is op-level, which autopar does not price), DDP (ZeRO-0)
  only without TP and PP ("DDP has not supported > 1D parallelism") or FSDP2 (ZeRO-3,
  without pipelining: torchtitan keeps FSDP's parameters gathered through a pipeline
  step, which autopar does not price yet), so with pipelining no data parallelism; bf16
  only under FSDP or without TP and PP (``maybe_enable_amp``: otherwise fp32), its
  gradients reduced in fp32 (FSDP's ``reduce_dtype``: 0.2.2 accepts "float32" alone; DDP
  under autocast keeps fp32 gradients); attention through ``scaled_dot_product_attention``
  with cuDNN, flash and math kernels in that order (``models/attention.py``
  ``ScaledDotProductAttentionWrapper``): flash in bf16 whatever the cluster says, math in
  fp32 (neither fused kernel takes fp32).
* ``deepspeed``: DeepSpeed's engine and pipeline engine: no tensor parallelism, 1F1B-style
  pipeline (``TrainSchedule``) without interleaving, stages of equal layer counts
  (``partition_method="type:..."``), ZeRO 0-3 without pipelining and ZeRO-1 with it (its
  pipeline engine runs ZeRO-0 under ``BF16_Optimizer``, a different precision), bf16
  gradients reduced in bf16 (its defaults, ``data_types.grad_accum_dtype`` and
  ``communication_data_type``, written out), activation checkpointing on every layer or
  none; the attention kernel of the model's own code, the cluster's.

Every target is a subset of what the cost model prices; each restriction is one field of
:class:`~autopar.contract.support.RuntimeSupport`.

Pure data over :mod:`autopar.contract.support` and the technique records: the planner's entry
(:mod:`autopar.api`) reads it without loading the framework emitters and readers
(:mod:`autopar.frameworks`, which read and price a framework's run through the api).
"""

from __future__ import annotations

from autopar.contract.plan import DTYPES
from autopar.contract.support import RUNTIME_SUPPORT, RuntimeSupport
from autopar.techniques.pipeline_schedules import framework_schedules
from autopar.techniques.recompute_modes import framework_recompute_modes
from autopar.techniques.tensor_parallel import framework_max_tp, framework_sequence_parallel
from autopar.techniques.zero_stages import framework_zero_stages

__all__ = ["TARGETS", "FRAMEWORKS", "target_support"]

TARGETS: dict[str, RuntimeSupport] = {
    "autopar": RUNTIME_SUPPORT,
    "megatron": RuntimeSupport(
        name="megatron", schedules=framework_schedules("megatron"),
        zero_stages=framework_zero_stages("megatron"),
        recompute=framework_recompute_modes("megatron"),
        sequence_parallel=framework_sequence_parallel("megatron"),
        virtual_stages=(1, 2, 3, 4), dtypes=DTYPES, grad_dtypes=("bf16", "fp32"),
        placements="megatron", recompute_layout="block", expert_parallel=True,
        moe_tp=False,
        attention_kernels=(("bf16", ("flash", "math")), ("fp32", ("math",)))),
    "torchtitan": RuntimeSupport(
        name="torchtitan", schedules=framework_schedules("torchtitan"),
        zero_stages=framework_zero_stages("torchtitan"),
        recompute=framework_recompute_modes("torchtitan"),
        sequence_parallel=framework_sequence_parallel("torchtitan"), virtual_stages=(1, 2, 3, 4),
        dtypes=DTYPES, grad_dtypes=("fp32",), placements="megatron", recompute_layout="uniform",
        ddp_1d_only=True, mixed_precision_by_fsdp=True,
        attention_kernels=(("bf16", ("flash",)), ("fp32", ("math",))), expert_parallel=False,
        context_parallel=False),
    "deepspeed": RuntimeSupport(
        name="deepspeed", schedules=framework_schedules("deepspeed"),
        zero_stages=framework_zero_stages("deepspeed"),
        recompute=framework_recompute_modes("deepspeed"),
        sequence_parallel=framework_sequence_parallel("deepspeed"), virtual_stages=(1,),
        dtypes=DTYPES, recompute_layout="uniform", even_stages=True,
        max_tp=framework_max_tp("deepspeed"),
        pipeline_zero_stages=(1,), expert_parallel=False, context_parallel=False),
}
"""Target name -> the plans its runner executes (module docstring)."""

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
"""The frameworks autopar emits configurations for (``--emit``)."""


def target_support(target: str) -> RuntimeSupport:
    """The :class:`~autopar.contract.support.RuntimeSupport` of ``target``; ValueError naming the
    targets for an unknown one."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[target]
