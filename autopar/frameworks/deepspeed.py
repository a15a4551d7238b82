"""A DeepSpeed config JSON, written from a plan and read back.

DeepSpeed's engine (``deepspeed.initialize``) and pipeline engine (``PipelineModule``)
run no tensor parallelism of their own, a 1F1B-style pipeline (``TrainSchedule``) without
interleaving over stages of equal layer counts, ZeRO 0-3 (2 and 3 only without
pipelining) and activation checkpointing every n layers; a plan for them comes from
``--target deepspeed``. The fields (``deepspeed/runtime/config.py``):

* ``train_batch_size`` B = ``train_micro_batch_size_per_gpu`` b ·
  ``gradient_accumulation_steps`` m · d (d = data-parallel ranks);
* ``zero_optimization.stage``; ``bf16.enabled`` (else fp32) with, written out, DeepSpeed
  0.19.8's defaults under bf16 that autopar prices: ``data_types.grad_accum_dtype`` "bf16"
  and ``communication_data_type`` "bf16" (bf16 gradients reduced in bf16; ZeRO-1: 2 + 2 +
  12/d bytes per parameter, ``runtime/zero/stage_1_and_2.py``). fp32 accumulation or
  reduction under bf16 is refused when read: autopar does not price it;
* ``pipeline`` (p > 1): ``stages`` p, ``partition`` ("type:<layer class>": equal counts
  of the transformer layers, the embedding with the first and the head with the last),
  ``activation_checkpoint_interval`` (1: every layer recomputed, 0: none). The pipeline
  engine reads only the interval from the config; the stage count and partition go to
  ``PipelineModule(num_stages=, partition_method=)`` in the model code (the lines in
  ``autopar.model_side``);
* p = 1: no config key makes DeepSpeed recompute (``activation_checkpointing`` only
  configures ``deepspeed.checkpointing``): with full recompute the model's layers call
  ``deepspeed.checkpointing.checkpoint``, which ``autopar.recompute`` states and
  ``autopar.model_side`` shows.

Expert parallelism (ep > 1) is refused by name: DeepSpeed's MoE is its own layer
(``deepspeed.moe.layer.MoE(ep_size=...)``) that the model code calls, another layer and API
than a Hugging Face experts module.
"""

from __future__ import annotations

import json

from autopar.frameworks.targets import FrameworkRun, outside_target
from autopar.contract.plan import Layout
from autopar.techniques.pipeline_schedules import schedule_for
from autopar.techniques.recompute_modes import recompute_mode, recompute_mode_for
from autopar.techniques.zero_stages import zero_stage

__all__ = ["deepspeed_config", "read_deepspeed_config", "LAYER_CLASS"]

LAYER_CLASS = "Block"
"""The transformer layer's class name in ``partition`` ("type:Block": autopar's GPT; use
your model's, e.g. "type:LlamaDecoderLayer")."""


def deepspeed_config(plan) -> dict:
    """The DeepSpeed config (a JSON-able dict) that runs ``plan`` (module docstring);
    ValueError when the plan is outside DeepSpeed's space
    (:func:`~autopar.frameworks.targets.outside_target`)."""
    if getattr(plan, "ep", 1) > 1:
        raise ValueError(f"ep={plan.ep}: DeepSpeed's expert parallelism is its own MoE layer "
                         "(deepspeed.moe.layer.MoE(ep_size=...)) that the model code calls, a "
                         "different layer and API from this model's experts; autopar does not "
                         "emit it; plan with --target deepspeed (ep=1) or emit for Megatron-LM")
    problem = outside_target(plan, "deepspeed")
    if problem:
        raise ValueError(problem)
    # one mode on every layer (the target's uniform recompute): its checkpoint interval
    interval = int(recompute_mode(plan.recompute[0]).frameworks["deepspeed"])
    config = {"train_batch_size": plan.global_batch_size,
              "train_micro_batch_size_per_gpu": plan.micro_batch_size,
              "gradient_accumulation_steps": plan.num_micro_batches,
              "zero_optimization": {"stage": plan.zero_stage},
              "bf16": {"enabled": plan.dtype == "bf16"}}
    if plan.dtype == "bf16":
        config |= {"data_types": {"grad_accum_dtype": "bf16"}, "communication_data_type": "bf16"}
    if plan.pp > 1:
        config["pipeline"] = {"stages": plan.pp, "partition": f"type:{LAYER_CLASS}",
                              "activation_checkpoint_interval": interval}
        model_side = [f"model = deepspeed.pipe.PipelineModule(layers=<embedding, {LAYER_CLASS} "
                      f"layers, head>, num_stages={plan.pp}, partition_method="
                      f"'type:{LAYER_CLASS}', activation_checkpoint_interval={interval}, "
                      "loss_fn=<loss>)"]
    else:
        model_side = ["model = <the model>"]
        if interval:
            model_side = ["deepspeed.checkpointing.configure(None, deepspeed_config=<this file>)",
                          f"in the model's forward, each {LAYER_CLASS}: x = "
                          "deepspeed.checkpointing.checkpoint(layer, x)"] + model_side
    model_side.append("engine, *_ = deepspeed.initialize(model=model, "
                      "model_parameters=model.parameters(), config=<this file>)")
    config |= {"steps_per_print": 10,
               "autopar": {"plan": f"tp={plan.tp} pp={plan.pp} dp={plan.dp} "
                                   f"mbs={plan.micro_batch_size} zero={plan.zero_stage}",
                           "recompute": plan.recompute[0],
                           "model_side": model_side,
                           "predicted_step_time_s": round(plan.predicted.step_time_s, 6)}}
    return config


def read_deepspeed_config(config: dict | str, num_gpus: int | None = None) -> FrameworkRun:
    """The run a DeepSpeed config (a dict or JSON text) states. d = B / (b·m) when all three
    are given, else ``num_gpus`` / p. Recompute: the pipeline's
    ``activation_checkpoint_interval``, else (p = 1) ``autopar.recompute`` where autopar
    wrote it, else none (the config cannot say what the model code checkpoints). Raises
    ValueError: not JSON, no micro-batch size, a batch that is not b·m·d, an inferred
    ("auto") pipeline, an interval other than 0 or 1, a precision autopar does not price
    (fp32 gradient accumulation or reduction under bf16, ZeRO-0 under a pipeline with bf16:
    ``BF16_Optimizer``)."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise ValueError(f"not a DeepSpeed config JSON: {exc}") from None
    pipe = config.get("pipeline", {})
    p = pipe.get("stages", 1)
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"pipeline.stages {p!r}: autopar reads an explicit stage count")
    b = config.get("train_micro_batch_size_per_gpu")
    if not isinstance(b, int) or b < 1:
        raise ValueError("the DeepSpeed config gives no train_micro_batch_size_per_gpu")
    B, m = config.get("train_batch_size"), config.get("gradient_accumulation_steps")
    if B and m:
        d = B // (b * m)
        if d * b * m != B:
            raise ValueError(f"train_batch_size {B} is not micro batch {b} x accumulation "
                             f"{m} x data-parallel ranks")
    elif num_gpus:
        d = num_gpus // p
        B = B or b * (m or 1) * d
    else:
        raise ValueError("give train_batch_size and gradient_accumulation_steps, or the GPUs")
    interval = pipe.get("activation_checkpoint_interval", 0)
    if p == 1 and not interval:
        written = config.get("autopar", {}).get("recompute", "none")  # what autopar emitted
        interval = int(recompute_mode(written).recomputes_layer)
    bf16 = bool(config.get("bf16", {}).get("enabled"))
    zero = config.get("zero_optimization", {}).get("stage", 0)
    if bf16:
        accum = config.get("data_types", {}).get("grad_accum_dtype", "bf16")
        reduce = config.get("communication_data_type") or "bf16"
        if accum != "bf16" or reduce != "bf16":
            raise ValueError(f"data_types.grad_accum_dtype {accum!r}, communication_data_type "
                             f"{reduce!r} under bf16: autopar prices bf16 gradients reduced in "
                             "bf16 (DeepSpeed's defaults); drop them or set both to \"bf16\"")
        if p > 1 and not zero_stage(zero).shards_optimizer:
            raise ValueError("zero_optimization.stage 0 under a pipeline with bf16: DeepSpeed "
                             "runs BF16_Optimizer (sharded fp32 master weights, a third "
                             "gradient copy), which autopar does not price; use stage 1")
    if interval not in (0, 1):
        raise ValueError(f"activation_checkpoint_interval {interval}: autopar prices 0 (none) "
                         "and 1 (every layer)")
    dtype = "bf16" if bf16 else "fp32"
    layout = Layout(tp=1, pp=p, dp=d, micro_batch_size=b, zero_stage=zero,
                    recompute=recompute_mode_for("deepspeed", str(interval)).name,
                    schedule=schedule_for("deepspeed", "TrainSchedule").name,
                    virtual_stages=1, sequence_parallel=False, ep=1, cp=1,
                    dtype=dtype, grad_dtype=dtype)
    known = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "zero_optimization", "bf16", "pipeline", "autopar", "data_types",
             "communication_data_type"}
    return FrameworkRun("deepspeed", layout, None, None, {}, B, None,
                        [k for k in config if k not in known])
