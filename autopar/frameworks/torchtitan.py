"""A torchtitan job TOML (torchtitan 0.2's ``JobConfig``), written from a plan and read back.

torchtitan trains Llama-family models with a fixed tensor-parallel plan (Megatron's
pattern, norms on sequence shards), so a plan for it comes from ``--target torchtitan``.
The fields (``torchtitan/config/job_config.py``):

* ``[parallelism]`` ``tensor_parallel_degree`` t, ``pipeline_parallel_degree`` p,
  ``data_parallel_replicate_degree`` (DDP: ZeRO-0) or ``data_parallel_shard_degree`` (FSDP2:
  ZeRO-3) d, ``pipeline_parallel_schedule`` ("GPipe", "1F1B", "Interleaved1F1B"),
  ``pipeline_parallel_microbatch_size`` b, ``module_fqns_per_model_part`` (the modules of
  each of the p·v model chunks, chunk c on rank c % p: ``tok_embeddings`` first,
  ``layers.i``, ``norm`` and ``output`` last);
* ``[training]`` ``local_batch_size`` (sequences per data-parallel rank per gradient
  accumulation step: b·m with pipelining, else b), ``global_batch_size`` B, ``seq_len`` s,
  ``mixed_precision_param`` ("bfloat16" | "float32");
* ``[activation_checkpoint]`` ``mode`` ("none" | "full").
"""

from __future__ import annotations

import tomllib

from autopar.frameworks.model_shape import model_shape
from autopar.frameworks.targets import FrameworkRun, outside_target
from autopar.plan import Layout

__all__ = ["torchtitan_toml", "read_torchtitan_toml", "TORCHTITAN_SCHEDULES"]

TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
"""autopar's schedule -> torchtitan's ``pipeline_parallel_schedule`` name."""

# torchtitan's Llama 3 flavors (torchtitan/models/llama3/__init__.py): (layers, dim) -> name
_FLAVORS = {(32, 4096): "8B", (80, 8192): "70B", (126, 16384): "405B"}


def _chunks(stage_layers: list[list[int]]) -> list[list[str]]:
    """``module_fqns_per_model_part`` of ``stage_layers``."""
    parts = [[f"layers.{i}" for i in range(lo, hi)] for lo, hi in stage_layers]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def _toml_value(value) -> str:
    """One TOML value: a string, bool, int or a list of lists of strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def torchtitan_toml(plan) -> str:
    """The torchtitan job TOML that runs ``plan`` (module docstring); ValueError when the
    plan is outside torchtitan's space (:func:`~autopar.frameworks.targets.outside_target`)."""
    problem = outside_target(plan, "torchtitan")
    if problem:
        raise ValueError(problem)
    shape = model_shape(plan.model_config)
    flavor = _FLAVORS.get((shape["num_layers"], shape["hidden_size"]))
    fsdp = plan.zero_stage == 3
    sections = {
        "job": {"description": f"autopar plan for {plan.model} on {plan.num_gpus} GPUs, "
                               f"predicted step {plan.predicted.step_time_s:.3f} s"},
        "model": {"name": "llama3", "flavor": flavor or "debugmodel"},
        "training": {"local_batch_size": plan.micro_batch_size * (
                         plan.num_micro_batches if plan.pp > 1 else 1),
                     "global_batch_size": plan.global_batch_size, "seq_len": plan.seq_len,
                     "mixed_precision_param": "bfloat16" if plan.dtype == "bf16" else "float32"},
        "parallelism": {"data_parallel_replicate_degree": 1 if fsdp else plan.dp,
                        "data_parallel_shard_degree": plan.dp if fsdp else 1,
                        "tensor_parallel_degree": plan.tp,
                        "pipeline_parallel_degree": plan.pp,
                        "pipeline_parallel_schedule": TORCHTITAN_SCHEDULES[plan.schedule],
                        "pipeline_parallel_microbatch_size": plan.micro_batch_size},
        "activation_checkpoint": {"mode": plan.recompute[0] if plan.recompute else "none"},
    }
    if plan.pp > 1:
        sections["parallelism"]["module_fqns_per_model_part"] = _chunks(plan.stage_layers)
    lines = [f"# autopar plan: tp={plan.tp} pp={plan.pp} dp={plan.dp} "
             f"mbs={plan.micro_batch_size} {plan.schedule} zero={plan.zero_stage}"]
    if flavor is None:
        lines.append(f"# no torchtitan llama3 flavor has {shape['num_layers']} layers of "
                     f"{shape['hidden_size']}: register one with this shape and name it here")
    for name, fields in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"


def _stage_layers(parts: list[list[str]]) -> list[list[int]]:
    """``stage_layers`` of ``module_fqns_per_model_part``; ValueError unless the layers
    run in order, the embedding first and the head last."""
    bounds, nxt = [], 0
    for c, part in enumerate(parts):
        layers = [int(m.split(".", 1)[1]) for m in part if m.startswith("layers.")]
        extra = [m for m in part if not m.startswith("layers.")]
        want = ((["tok_embeddings"] if c == 0 else [])
                + (["norm", "output"] if c == len(parts) - 1 else []))
        if layers != list(range(nxt, nxt + len(layers))) or not layers or extra != want:
            raise ValueError(f"module_fqns_per_model_part[{c}] = {part}: autopar reads chunks "
                             "of consecutive layers.i, tok_embeddings in the first and norm, "
                             "output in the last")
        bounds.append([nxt, nxt + len(layers)])
        nxt += len(layers)
    return bounds


def read_torchtitan_toml(text: str) -> FrameworkRun:
    """The run a torchtitan job TOML ``text`` states (module docstring). Raises ValueError
    for a TOML error, HSDP (both data-parallel degrees > 1), a negative (inferred) degree,
    an unknown schedule or activation-checkpointing mode, or chunks autopar cannot read."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not a torchtitan job TOML: {exc}") from None
    par, train = data.get("parallelism", {}), data.get("training", {})
    ac = data.get("activation_checkpoint", {}).get("mode", "selective")
    replicate = par.get("data_parallel_replicate_degree", 1)
    shard = par.get("data_parallel_shard_degree", -1)
    if shard < 1 or replicate < 1 or (shard > 1 and replicate > 1):
        raise ValueError(f"data_parallel_replicate_degree={replicate}, data_parallel_shard_"
                         f"degree={shard}: autopar reads DDP or FSDP with explicit degrees, "
                         "not HSDP or an inferred -1")
    t, p = par.get("tensor_parallel_degree", 1), par.get("pipeline_parallel_degree", 1)
    schedules = {v: k for k, v in TORCHTITAN_SCHEDULES.items()}
    name = par.get("pipeline_parallel_schedule", "1F1B")
    if name not in schedules or ac not in ("none", "full"):
        raise ValueError(f"pipeline_parallel_schedule {name!r} / activation_checkpoint.mode "
                         f"{ac!r}: autopar prices {sorted(schedules)} and modes none, full")
    parts = par.get("module_fqns_per_model_part")
    if name == "Interleaved1F1B" and not parts:
        raise ValueError("Interleaved1F1B: give module_fqns_per_model_part (pp*v chunks) so "
                         "autopar knows the virtual stages")
    stages = _stage_layers(parts) if parts else None
    if stages and len(stages) % p:
        raise ValueError(f"module_fqns_per_model_part has {len(stages)} chunks, not a "
                         f"multiple of pipeline_parallel_degree={p}")
    v = len(stages) // p if stages else 1
    b = (par.get("pipeline_parallel_microbatch_size", 1) if p > 1
         else train.get("local_batch_size", 8))
    d = replicate * shard
    layout = Layout(tp=t, pp=p, dp=d, micro_batch_size=b, zero_stage=3 if shard > 1 else 0,
                    recompute=ac, schedule=schedules[name], virtual_stages=v,
                    sequence_parallel=t > 1,
                    dtype="bf16" if train.get("mixed_precision_param", "bfloat16") == "bfloat16"
                    else "fp32")
    batch = train.get("global_batch_size", -1)
    known = {"parallelism", "training", "activation_checkpoint"}
    ignored = [f"[{s}]" for s in data if s not in known]
    return FrameworkRun("torchtitan", layout, stages, None,
                        {"seq_length": train.get("seq_len", 2048)},
                        batch if batch > 0 else train.get("local_batch_size", 8) * d,
                        train.get("seq_len", 2048), ignored)
