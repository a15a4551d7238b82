"""Plans to framework configurations and back, and a framework's run priced.

:func:`emit` writes a plan for a framework, :func:`read` reads a framework's configuration
back into a :class:`~autopar.frameworks.targets.FrameworkRun`, and :func:`price_run`
prices that run with the cost model every plan uses (``autopar.evaluate`` with the run's own
stage split and per-layer recompute), so a launch script and autopar's plan compare on
equal terms.
"""

from __future__ import annotations

import json
from dataclasses import replace

from autopar.frameworks.deepspeed import deepspeed_config, read_deepspeed_config
from autopar.frameworks.megatron import format_megatron_args, read_megatron_args
from autopar.frameworks.megatron_moe import moe_config
from autopar.frameworks.model_shape import build_model, model_problem
from autopar.frameworks.targets import FRAMEWORKS, FrameworkRun
from autopar.frameworks.torchtitan import read_torchtitan_toml, torchtitan_toml
from cost_models.hardware import Cluster

__all__ = ["emit", "read", "price_run"]


def emit(plan, framework: str) -> str:
    """``plan`` as ``framework``'s configuration text: Megatron-LM flags
    (:func:`~autopar.frameworks.megatron.format_megatron_args`), a torchtitan job TOML or a
    DeepSpeed config JSON. Raises ValueError for an unknown framework, a model the framework
    would not train as it is (:func:`~autopar.frameworks.model_shape.model_problem`) or a
    plan outside its space (the message says to plan with ``--target``)."""
    if framework in FRAMEWORKS:
        problem = model_problem(plan.model_config, framework)
        if problem:
            raise ValueError(problem)
    if framework == "megatron":
        return format_megatron_args(plan)
    if framework == "torchtitan":
        return torchtitan_toml(plan)
    if framework == "deepspeed":
        return json.dumps(deepspeed_config(plan), indent=2) + "\n"
    raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")


def read(text: str, framework: str, num_gpus: int | None = None) -> FrameworkRun:
    """What :func:`emit` wrote (or any configuration of that framework) read back;
    ``num_gpus`` gives d where the configuration does not (Megatron-LM's flags)."""
    if framework == "megatron":
        return read_megatron_args(text, num_gpus)
    if framework == "torchtitan":
        return read_torchtitan_toml(text)
    if framework == "deepspeed":
        return read_deepspeed_config(text, num_gpus)
    raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")


def price_run(run: FrameworkRun, cluster, *, model=None, model_name: str | None = None,
              global_batch_size: int | None = None, seq_len: int | None = None):
    """``autopar.evaluate`` of ``run`` on ``cluster``: its layout, stage split and
    per-layer recompute, on ``model`` (default: the model its shape states,
    :func:`~autopar.frameworks.model_shape.build_model`) with its batch and sequence length
    unless given, with the attention kernel it runs (``run.attention``, else the cluster's).
    A run's experts (``--num-experts``, ``--moe-router-topk``) must be ``model``'s.
    d defaults to the cluster's GPUs / (t·p). Raises ValueError (a shape or
    batch the run does not state, degrees that do not fit) and InfeasibleError like
    ``evaluate``."""
    from autopar.api import evaluate

    if model is None:
        model, model_name = build_model(run.model)
    else:
        _check_experts(run, getattr(getattr(model, "config", None), "to_dict", dict)())
    layout = run.layout
    if layout.dp is None:
        n = cluster.num_gpus
        if n % (layout.tp * layout.pp):
            raise ValueError(f"{n} GPUs are not divisible by tp*pp = {layout.tp}*{layout.pp}")
        layout = replace(layout, dp=n // (layout.tp * layout.pp))
    batch = global_batch_size or run.global_batch_size
    seq = seq_len or run.seq_len
    if not batch or not seq:
        raise ValueError(f"the {run.framework} configuration states no "
                         f"{'global batch size' if not batch else 'sequence length'}; give it")
    if run.attention is not None and isinstance(cluster, Cluster):
        cluster = replace(cluster, attention=run.attention)  # the kernel the run uses
    return evaluate(model, cluster, layout, global_batch_size=batch, seq_len=seq,
                    model_name=model_name or "model", stage_layers=run.stage_layers,
                    recompute=run.recompute)


def _check_experts(run: FrameworkRun, config: dict) -> None:
    """ValueError when ``run`` states experts (E, top-k) that ``config``, the model being
    priced, does not have: the run would train another model than the one priced."""
    if "num_experts" not in run.model:
        return
    moe = moe_config(config) or {}
    stated = (run.model["num_experts"], run.model.get("moe_router_topk", 2))
    have = (moe.get("num_experts"), moe.get("moe_router_topk"))
    if stated != have:
        raise ValueError(f"--num-experts {stated[0]} --moe-router-topk {stated[1]}: the model "
                         f"priced has {have[0]} experts, top-{have[1]}; give the model the "
                         "flags were written for")
