"""A torchtitan job TOML (torchtitan 0.2's ``JobConfig``), written from a plan and read back.

torchtitan trains Llama-family models with a fixed tensor-parallel plan (Megatron's
pattern, norms on sequence shards), so a plan for it comes from ``--target torchtitan``.
The fields (``torchtitan/config/job_config.py``):

* ``[parallelism]`` ``tensor_parallel_degree`` t, ``pipeline_parallel_degree`` p,
  ``data_parallel_replicate_degree`` (DDP: ZeRO-0) or ``data_parallel_shard_degree`` (FSDP2:
  ZeRO-3) d, ``pipeline_parallel_schedule`` ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
  ``pipeline_parallel_microbatch_size`` b, ``module_fqns_per_model_part`` (the modules of
  each of the p·v model chunks in model order, which torchtitan places as the schedule
  does (chunk c on rank c % p; ZBVZeroBubble's V: rank r holds r and 2p - 1 - r): ``tok_embeddings`` first,
  ``layers.i``, ``norm`` and ``output`` last);
* ``[training]`` ``local_batch_size`` (sequences per data-parallel rank per gradient
  accumulation step: b·m with pipelining, else b), ``global_batch_size`` B, ``seq_len`` s,
  ``mixed_precision_param`` ("bfloat16" | "float32": FSDP's parameter dtype, or autocast's
  without TP and PP; with TP or PP and no FSDP torchtitan trains fp32,
  ``distributed/utils.py:maybe_enable_amp``), ``mixed_precision_reduce`` ("float32", the
  only value 0.2.2 accepts: gradients reduced in fp32);
* ``[activation_checkpoint]`` ``mode`` ("none" | "full");
* ``[model]`` ``name`` "llama3" and ``flavor``: the llama3 flavor of the model's exact shape,
  or :data:`FLAVOR` with the ``TransformerModelArgs`` to register written in the header
  (:func:`torchtitan_model_args`); a model torchtitan does not define is refused.

The header's first lines are the ``torchrun`` launch of the plan's nodes.

Expert parallelism (``parallelism.expert_parallel_degree``) is neither emitted nor read:
torchtitan 0.2.2 runs MoE layers only in its own deepseek_v3, qwen3 and llama4 models
(autopar emits llama3), and its EP borrows ranks from the FSDP dimension
(``distributed/parallel_dims.py:ParallelDims``: efsdp = dp_shard·cp·tp / (etp·ep), etp 1 or
tp; dp_replicate is not borrowed), while autopar prices EP over data-parallel ranks without
ZeRO (:func:`autopar.techniques.expert_parallel.ep_problem`); a TOML with
``expert_parallel_degree`` > 1 is refused by name.
"""

from __future__ import annotations

import tomllib

from autopar.frameworks.model_shape import model_problem, model_shape
from autopar.frameworks.targets import (FrameworkRun, outside_target, target_support,
                                        torchrun_line)
from autopar.contract.plan import Layout
from autopar.techniques.pipeline_schedules import pipeline_schedule, schedule_for
from autopar.techniques.recompute_modes import (framework_recompute_modes, recompute_mode,
                                                recompute_mode_for)
from autopar.techniques.zero_stages import zero_stage

__all__ = ["torchtitan_toml", "read_torchtitan_toml", "torchtitan_model_args", "ffn_hidden_size",
           "FLAVOR"]


# torchtitan 0.2.2's Llama 3 flavors (torchtitan/models/llama3/__init__.py, llama3_args),
# the TransformerModelArgs fields that set the shape; the rest are its defaults
_DEFAULTS = {"vocab_size": 128256, "norm_eps": 1e-5}
_FLAVORS = {
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
               multiple_of=1024, rope_theta=500000),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                multiple_of=4096, rope_theta=500000),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                 multiple_of=4096, rope_theta=500000),
}
FLAVOR = "autopar"
"""The flavor name the emitted TOML gives a model no torchtitan flavor reproduces; its
``TransformerModelArgs`` are written in the TOML's header, to register as
``llama3_args["autopar"]`` in ``torchtitan/models/llama3/__init__.py``."""


def ffn_hidden_size(args: dict) -> int:
    """The SwiGLU hidden size torchtitan's llama3 ``FeedForward`` builds from
    ``TransformerModelArgs`` fields ``args`` (``model/model.py``: int(2·4·dim/3), times
    ``ffn_dim_multiplier`` when set, rounded up to a multiple of ``multiple_of``)."""
    hidden = int(2 * 4 * args["dim"] / 3)
    if args.get("ffn_dim_multiplier") is not None:
        hidden = int(args["ffn_dim_multiplier"] * hidden)
    multiple = args.get("multiple_of", 256)
    return multiple * ((hidden + multiple - 1) // multiple)


def _shape_of(args: dict) -> tuple:
    """What of a model ``args`` sets: layers, dim, heads, kv heads, ffn, vocab, rope, eps."""
    a = {**_DEFAULTS, **args}
    return (a["n_layers"], a["dim"], a["n_heads"], a.get("n_kv_heads") or a["n_heads"],
            ffn_hidden_size(a), a["vocab_size"], float(a.get("rope_theta", 10000)),
            float(a["norm_eps"]))


def torchtitan_model_args(plan) -> tuple[str, dict]:
    """(flavor, ``TransformerModelArgs`` keyword arguments) of ``plan``'s model in
    torchtitan's llama3: the flavor of that exact shape (layers, dim, heads, kv heads, FFN
    size, vocabulary, rope theta, norm eps) when torchtitan has one, else :data:`FLAVOR`
    with arguments that reproduce it: ``multiple_of`` the FFN size (and
    ``ffn_dim_multiplier`` below 1 when 8·dim/3 exceeds it), so the rounding lands on it
    exactly. ``max_seq_len`` is the plan's s (torchtitan sets it from ``training.seq_len``).
    Raises ValueError for a model torchtitan does not define
    (:func:`~autopar.frameworks.model_shape.model_problem`)."""
    problem = model_problem(plan.model_config, "torchtitan")
    if problem:
        raise ValueError(problem)
    shape = model_shape(plan.model_config)
    h, ffn = shape["hidden_size"], shape["ffn_hidden_size"]
    base = int(2 * 4 * h / 3)
    args = dict(dim=h, n_layers=shape["num_layers"], n_heads=shape["num_attention_heads"],
                n_kv_heads=shape["num_query_groups"], vocab_size=shape["vocab_size"],
                multiple_of=ffn, ffn_dim_multiplier=None if base <= ffn else ffn / base,
                norm_eps=float(shape.get("norm_eps", 1e-5)),
                rope_theta=float(shape.get("rope_theta", 10000)), max_seq_len=plan.seq_len)
    assert ffn_hidden_size(args) == ffn, (args, ffn)
    for name, flavor in _FLAVORS.items():
        if _shape_of(flavor) == _shape_of(args):
            return name, args
    return FLAVOR, args


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
    flavor, args = torchtitan_model_args(plan)
    fsdp = zero_stage(plan.zero_stage).shards_parameters
    sections = {
        "job": {"description": f"autopar plan for {plan.model} on {plan.num_gpus} GPUs, "
                               f"predicted step {plan.predicted.step_time_s:.3f} s"},
        "model": {"name": "llama3", "flavor": flavor},
        "training": {"local_batch_size": plan.micro_batch_size * (
                         plan.num_micro_batches if plan.pp > 1 else 1),
                     "global_batch_size": plan.global_batch_size, "seq_len": plan.seq_len,
                     "mixed_precision_param": "bfloat16" if plan.dtype == "bf16" else "float32",
                     "mixed_precision_reduce": "float32"},
        "parallelism": {"data_parallel_replicate_degree": 1 if fsdp else plan.dp,
                        "data_parallel_shard_degree": plan.dp if fsdp else 1,
                        "tensor_parallel_degree": plan.tp,
                        "pipeline_parallel_degree": plan.pp,
                        "pipeline_parallel_schedule": pipeline_schedule(plan.schedule).framework_name("torchtitan"),
                        "pipeline_parallel_microbatch_size": plan.micro_batch_size},
        "activation_checkpoint": {"mode": recompute_mode(plan.recompute[0]).frameworks[
            "torchtitan"]},  # one mode on every layer: the target's uniform recompute
    }
    if plan.pp > 1:
        sections["parallelism"]["module_fqns_per_model_part"] = _chunks(plan.stage_layers)
    lines = [f"# autopar plan: tp={plan.tp} pp={plan.pp} dp={plan.dp} "
             f"mbs={plan.micro_batch_size} {plan.schedule} zero={plan.zero_stage}",
             f"# {torchrun_line(plan)} -m torchtitan.train --job.config_file <this file>"]
    if flavor == FLAVOR:
        fields = ", ".join(f"{k}={v!r}" for k, v in args.items() if k != "max_seq_len")
        lines += ["# no torchtitan llama3 flavor has this model's shape; register it in",
                  "# torchtitan/models/llama3/__init__.py before training:",
                  f'#   llama3_args["{FLAVOR}"] = TransformerModelArgs({fields}, '
                  "rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0))",
                  "# (RoPEScalingArgs from torchtitan.models.llama3.model.args; a factor of 1 "
                  "leaves rotary frequencies unscaled: set Llama 3.1's scaling if yours has it)"]
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
    if par.get("context_parallel_degree", 1) > 1:  # never read as data parallelism
        raise ValueError(f"context_parallel_degree={par['context_parallel_degree']}: "
                         "torchtitan's context parallelism (ring attention) is not priced by "
                         "autopar yet; it would price another run, so it refuses it")
    if par.get("expert_parallel_degree", 1) > 1:
        raise ValueError(f"expert_parallel_degree={par['expert_parallel_degree']}: torchtitan "
                         "folds EP over its FSDP ranks (ParallelDims: efsdp = dp_shard*cp*tp/"
                         "(etp*ep)), autopar prices EP over data-parallel ranks without ZeRO; "
                         "not priced")
    if replicate > 1 and (t > 1 or p > 1):
        raise ValueError(f"data_parallel_replicate_degree={replicate} with tensor/pipeline "
                         f"parallel degrees {t}/{p}: torchtitan stops at start-up (\"DDP has "
                         "not supported > 1D parallelism\"); shard the data-parallel degree "
                         "(data_parallel_shard_degree) instead")
    support = target_support("torchtitan")
    dtype = "bf16" if train.get("mixed_precision_param", "bfloat16") == "bfloat16" else "fp32"
    notes = []
    if support.dtype_for(dtype, t, p, replicate * shard) != dtype:
        dtype = "fp32"
        notes.append("mixed_precision_param bfloat16 with TP or PP and no FSDP: torchtitan "
                     "trains fp32 (maybe_enable_amp), priced so")
    name = par.get("pipeline_parallel_schedule", "1F1B")  # torchtitan's JobConfig default
    schedule = schedule_for("torchtitan", name)
    try:
        recompute = recompute_mode_for("torchtitan", ac).name
    except ValueError as exc:
        raise ValueError(f"activation_checkpoint.mode {ac!r}: autopar prices modes "
                         f"{', '.join(framework_recompute_modes('torchtitan'))} ({exc})") from None
    parts = par.get("module_fqns_per_model_part")
    if schedule.interleaved and not parts:
        raise ValueError(f"{name}: give module_fqns_per_model_part (pp*v chunks) so "
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
                    recompute=recompute, schedule=schedule.name, virtual_stages=v,
                    sequence_parallel=t > 1, dtype=dtype, grad_dtype="fp32",
                    ep=1, cp=1)  # expert and context parallel degrees > 1 refused above
    batch = train.get("global_batch_size", -1)
    known = {"parallelism", "training", "activation_checkpoint"}
    ignored = [f"[{s}]" for s in data if s not in known] + notes
    return FrameworkRun("torchtitan", layout, stages, None,
                        {"seq_length": train.get("seq_len", 2048)},
                        batch if batch > 0 else train.get("local_batch_size", 8) * d,
                        train.get("seq_len", 2048), ignored, support.attention_for("flash", dtype))
