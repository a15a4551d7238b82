"""A DeepSpeed config JSON, written from a plan and read back.

DeepSpeed's engine (``deepspeed.initialize``) and pipeline engine (``PipelineModule``)
run no tensor parallelism of their own, a 1F1B-style pipeline (``TrainSchedule``) without
interleaving over stages of equal layer counts, ZeRO 0-3 (2 and 3 only without
pipelining) and activation checkpointing every n layers; a plan for them comes from
``--target deepspeed``. The fields (``deepspeed/runtime/config.py``):

* ``train_batch_size`` B = ``train_micro_batch_size_per_gpu`` b ·
  ``gradient_accumulation_steps`` m · d (d = data-parallel ranks);
* ``zero_optimization.stage``; ``bf16.enabled`` (else fp32);
* ``pipeline``: ``stages`` p, ``partition`` ("type:<layer class>": equal counts of the
  transformer layers, the embedding with the first and the head with the last),
  ``activation_checkpoint_interval`` (1: every layer recomputed, 0: none). With p > 1 the
  same values go to ``PipelineModule(num_stages=, partition_method=,
  activation_checkpoint_interval=)``; with p = 1 the model's layers call
  ``deepspeed.checkpointing.checkpoint`` when the interval is 1.
"""

from __future__ import annotations

import json

from autopar.frameworks.targets import FrameworkRun, outside_target
from autopar.plan import Layout

__all__ = ["deepspeed_config", "read_deepspeed_config", "LAYER_CLASS"]

LAYER_CLASS = "Block"
"""The transformer layer's class name in ``partition`` ("type:Block": autopar's GPT; use
your model's, e.g. "type:LlamaDecoderLayer")."""


def deepspeed_config(plan) -> dict:
    """The DeepSpeed config (a JSON-able dict) that runs ``plan`` (module docstring);
    ValueError when the plan is outside DeepSpeed's space
    (:func:`~autopar.frameworks.targets.outside_target`)."""
    problem = outside_target(plan, "deepspeed")
    if problem:
        raise ValueError(problem)
    return {"train_batch_size": plan.global_batch_size,
            "train_micro_batch_size_per_gpu": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.num_micro_batches,
            "zero_optimization": {"stage": plan.zero_stage},
            "bf16": {"enabled": plan.dtype == "bf16"},
            "pipeline": {"stages": plan.pp, "partition": f"type:{LAYER_CLASS}",
                         "activation_checkpoint_interval": int("full" in plan.recompute)},
            "steps_per_print": 10,
            "autopar": {"plan": f"tp={plan.tp} pp={plan.pp} dp={plan.dp} "
                                f"mbs={plan.micro_batch_size} zero={plan.zero_stage}",
                        "predicted_step_time_s": round(plan.predicted.step_time_s, 6)}}


def read_deepspeed_config(config: dict | str, num_gpus: int | None = None) -> FrameworkRun:
    """The run a DeepSpeed config (a dict or JSON text) states. d = B / (b·m) when all three
    are given, else ``num_gpus`` / p. Raises ValueError: not JSON, no micro-batch size,
    a batch that is not b·m·d, an inferred ("auto") pipeline, an interval other than 0 or 1."""
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
    if interval not in (0, 1):
        raise ValueError(f"activation_checkpoint_interval {interval}: autopar prices 0 (none) "
                         "and 1 (every layer)")
    layout = Layout(tp=1, pp=p, dp=d, micro_batch_size=b,
                    zero_stage=config.get("zero_optimization", {}).get("stage", 0),
                    recompute="full" if interval else "none", schedule="1f1b",
                    virtual_stages=1, sequence_parallel=False,
                    dtype="bf16" if config.get("bf16", {}).get("enabled") else "fp32")
    known = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "zero_optimization", "bf16", "pipeline", "autopar"}
    return FrameworkRun("deepspeed", layout, None, None, {}, B, None,
                        [k for k in config if k not in known])
