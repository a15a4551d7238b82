"""Speak the frameworks' own language: Megatron-LM flags in, Megatron-LM / torchtitan /
DeepSpeed configurations out, and plans searched inside what each of them executes.

* :mod:`~autopar.frameworks.targets`: each runner's executable space (``TARGETS``, used by
  ``autopar.plan(..., target=)``) and :class:`FrameworkRun`, a framework's run in autopar's
  terms;
* :mod:`~autopar.frameworks.megatron`: Megatron-LM's pretraining flags, read and written
  (its MoE and expert-parallel flags: :mod:`~autopar.frameworks.megatron_moe`);
* :mod:`~autopar.frameworks.torchtitan`: a torchtitan job TOML, written and read;
* :mod:`~autopar.frameworks.deepspeed`: a DeepSpeed config JSON, written and read;
* :func:`emit`, :func:`read` and :func:`price_run` tie them to the plan and the cost model.
"""

from __future__ import annotations

from autopar.frameworks.targets import (FRAMEWORKS, TARGETS, FrameworkRun, outside_target,
                                        target_support)
from autopar.frameworks.megatron import format_megatron_args, megatron_args, read_megatron_args
from autopar.frameworks.torchtitan import read_torchtitan_toml, torchtitan_toml
from autopar.frameworks.deepspeed import deepspeed_config, read_deepspeed_config
from autopar.frameworks.model_shape import model_problem
from autopar.frameworks.pricing import emit, price_run, read

__all__ = ["FRAMEWORKS", "TARGETS", "FrameworkRun", "outside_target", "target_support",
           "megatron_args", "format_megatron_args", "read_megatron_args", "torchtitan_toml",
           "read_torchtitan_toml", "deepspeed_config", "read_deepspeed_config", "emit", "read",
           "price_run", "model_problem"]
