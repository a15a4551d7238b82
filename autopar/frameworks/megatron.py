"""Megatron-LM's pretraining flags: read a launch script's, and write a plan's.

:func:`read_megatron_args` reads ``pretrain_gpt.py`` flags (a string, a file, a launch
script whose bash arrays or variables hold them) into a :class:`FrameworkRun`;
:func:`megatron_args` writes a plan as the flags that run it. The flags (Megatron-LM's
``megatron/training/arguments.py``; megatron-core's ``TransformerConfig`` field of the same
name with underscores):

* parallel sizes: ``--tensor-model-parallel-size`` t, ``--pipeline-model-parallel-size`` p
  (d = GPUs / (t·c·p)), ``--sequence-parallel``, ``--use-distributed-optimizer`` (ZeRO-1);
* batch: ``--micro-batch-size`` b, ``--global-batch-size`` B (default d·b);
* pipeline: ``--num-layers-per-virtual-pipeline-stage`` n (v = L / (p·n)) or
  ``--num-virtual-stages-per-pipeline-rank`` v (interleaved 1F1B when v > 1);
  ``--pipeline-model-parallel-layout "Et*3|t*4|t*4|t*5L"`` (stages split by ``|``, ``t`` a
  transformer layer, ``E`` the embedding, ``L`` the loss, ``x*k`` and ``(..)*k`` repeats)
  or ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` for
  uneven stages; otherwise L / p layers per stage;
* recompute: ``--recompute-granularity full|selective``, ``--recompute-method uniform|block``,
  ``--recompute-num-layers`` k (block: the first k layers of every stage recomputed),
  ``--recompute-activations`` (selective); the 2021 names ``--checkpoint-activations``,
  ``--activations-checkpoint-method`` and ``--activations-checkpoint-num-layers`` of the SC21
  scripts mean full recompute;
* precision: ``--bf16``, ``--fp16`` (priced as bf16: the same bytes and tensor-core rate),
  neither: fp32; under ``--bf16`` the gradients are fp32 ``main_grad`` buffers reduced in
  fp32 (arguments.py sets ``accumulate_allreduce_grads_in_fp32``) unless
  ``--grad-reduce-in-bf16`` or ``--main-grads-dtype bf16`` (``grad_dtype`` "bf16", what
  autopar emits: the precision its plans are priced in); under ``--fp16`` half-precision
  ones unless ``--accumulate-allreduce-grads-in-fp32``;
* attention: ``--attention-backend`` (default ``auto``): flash, fused and auto priced as the
  "flash" kernel in 16-bit training, unfused and local as "math"; fp32 runs unfused
  (:data:`ATTENTION_BACKENDS`);
* model: ``--num-layers --hidden-size --num-attention-heads --ffn-hidden-size
  --num-query-groups --seq-length --vocab-size`` (or ``--padded-vocab-size``), ``--swiglu``,
  ``--untie-embeddings-and-output-weights``, ``--hidden-dropout`` (Megatron-LM's default
  0.1; ``--attention-dropout`` is read with it).

* mixture of experts and expert parallelism (``--num-experts``, ``--moe-router-topk``,
  ``--moe-ffn-hidden-size``, ``--expert-model-parallel-size`` ep, ``--expert-tensor-parallel-size``,
  ``--moe-token-dispatcher-type``, ``--moe-grouped-gemm``): :mod:`~autopar.frameworks.megatron_moe`
  (ep read into ``Layout.ep``; alltoall dispatch and expert-TP 1 priced, the rest refused).

* context parallelism: ``--context-parallel-size`` c into ``Layout.cp``, emitted with
  ``--cp-comm-type all_gather`` (what autopar prices); the default ``p2p`` ring is priced as
  all-gather (the same K/V bytes, not overlapped; said in ``ignored``), ``a2a`` refused.

Read as Megatron-LM reads them, or refused by name where autopar cannot price the run
yet (:func:`_refuse_unpriced`): ``--use-megatron-fsdp``, ``--use-torch-fsdp2``, any ``--fp8-*`` flag,
``--recompute-modules`` other than ``core_attn`` under selective recompute. ``--swiglu``
without ``--ffn-hidden-size`` has int(8h/3/64)·64 (arguments.py); ``--num-query-groups``
counts only with ``--group-query-attention``; ``--pipeline-model-parallel-layout`` may hold p·v stages
(interleaved); block recompute needs ``--recompute-num-layers``. A launch script's plain
variables (``NAME=value``, ``NAME=${X:-default}``) are substituted and a quoted array
element holding a flag and its value is split, as bash would run the script without
arguments.

Every other flag is listed in ``FrameworkRun.ignored``.
"""

from __future__ import annotations

import shlex

from autopar.frameworks.launch_script import script_words
from autopar.frameworks.megatron_attention import ATTENTION_BACKENDS
from autopar.frameworks.megatron_attention import attention_kernel as _attention
from autopar.frameworks.megatron_layout import parse_pp_layout, pp_layout
from autopar.frameworks.megatron_moe import (MOE_BOOL, MOE_INT, MOE_TEXT, moe_model_args,
                                             moe_parallel_args, moe_plan_problem, read_moe_flags)
from autopar.frameworks.model_shape import model_shape
from autopar.frameworks.targets import (FrameworkRun, megatron_block_layers, outside_target,
                                        torchrun_line)
from autopar.models import pad_vocab_size
from autopar.contract.plan import Layout
from autopar.techniques.pipeline_schedules import default_schedule
from autopar.techniques.recompute_modes import mode_recomputing, recompute_mode, recompute_mode_for
from autopar.techniques.tensor_parallel import tensor_parallel_mode
from autopar.techniques.zero_stages import zero_stage
from autopar.contract.stages import equal_chunks
from autopar.contract.support import plan_grad_dtype

__all__ = ["read_megatron_args", "megatron_args", "format_megatron_args", "parse_pp_layout",
           "pp_layout", "ATTENTION_BACKENDS"]
# the recompute modes by what they recompute (their answers: Megatron-LM's granularities)
_NOTHING, _CORE, _LAYER = (mode_recomputing(w) for w in ("nothing", "attention_core", "layer"))

_INT = ("tensor-model-parallel-size", "pipeline-model-parallel-size", "micro-batch-size",
        "global-batch-size", "num-layers", "hidden-size", "num-attention-heads",
        "ffn-hidden-size", "num-query-groups", "seq-length", "vocab-size", "padded-vocab-size",
        "recompute-num-layers", "activations-checkpoint-num-layers",
        "num-layers-per-virtual-pipeline-stage", "num-virtual-stages-per-pipeline-rank",
        "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
        "max-position-embeddings", "make-vocab-size-divisible-by", "context-parallel-size",
        *MOE_INT)
_TEXT = ("recompute-granularity", "recompute-method", "activations-checkpoint-method",
         "pipeline-model-parallel-layout", "main-grads-dtype", "attention-backend",
         "cp-comm-type", *MOE_TEXT)
_FLOAT = ("hidden-dropout", "attention-dropout")
_BOOL = ("sequence-parallel", "use-distributed-optimizer", "bf16", "fp16", "swiglu",
         "group-query-attention", "untie-embeddings-and-output-weights",
         "recompute-activations", "checkpoint-activations", "grad-reduce-in-bf16",
         "accumulate-allreduce-grads-in-fp32", "use-megatron-fsdp", "use-torch-fsdp2", *MOE_BOOL)
_LIST = ("recompute-modules",)  # nargs="+"
_REFUSED = {  # read, not priced yet: refused by name, never priced as something else
    "cp-comm-type": lambda v: v in ("a2a", "a2a+p2p") and f"context parallelism by {v}",
    "use-megatron-fsdp": lambda v: "Megatron-FSDP (sharded data parallelism)",
    "use-torch-fsdp2": lambda v: "PyTorch FSDP2 under Megatron-LM",
}


def _flags(words: list[str]) -> tuple[dict, list[str]]:
    """{flag: value} (True for a switch) of the words, and the flags not known here."""
    out, unknown, i = {}, [], 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue  # a command, a bash array's name, a value of an unknown flag
        name, eq, inline = word[2:].partition("=")
        if name in _BOOL:
            out[name] = True
            continue
        if name in _LIST:
            values = [inline] if eq else []
            while not eq and i < len(words) and not words[i].startswith("--"):
                values.append(words[i])
                i += 1
            out[name] = values
            continue
        takes = name in _INT or name in _TEXT or name in _FLOAT or not (
            i >= len(words) or words[i].startswith("--"))
        value = inline if eq else (words[i] if takes and i < len(words) else None)
        i += 0 if eq or not takes else 1
        if name in _FLOAT:
            try:
                out[name] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"--{name} {value}: expected a number") from None
        elif name in _INT or name in _TEXT:
            if value is None or "$" in value:
                raise ValueError(f"--{name} {value or ''}: "
                                 + ("a shell variable; substitute the script's variables "
                                    "first" if value else "needs a value"))
            if name in _INT:
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"--{name} {value}: expected a positive integer")
                value = int(value)
            out[name] = value
        else:
            unknown.append(f"--{name}" + (f" {value}" if value is not None else ""))
    return out, unknown


def _stages(flags: dict, L: int, p: int, v: int,
            layout: list[int] | None) -> list[list[int]] | None:
    """``stage_layers`` when the flags cut the stages unevenly, else None (L / p each);
    ``layout``: the layers per stage of ``--pipeline-model-parallel-layout``, parsed."""
    first, last = (flags.get("decoder-first-pipeline-num-layers"),
                   flags.get("decoder-last-pipeline-num-layers"))
    if layout is not None:
        counts = layout
    elif first or last:
        inner = L - (first or 0) - (last or 0)
        middle = p - bool(first) - bool(last)
        if inner < 0 or (middle and inner % middle) or (not middle and inner):
            raise ValueError(f"--decoder-first/last-pipeline-num-layers {first}/{last}: the "
                             f"other {max(middle, 0)} stages cannot share {inner} of the {L} "
                             "layers evenly")
        counts = ([first] if first else []) + [inner // middle if middle else 0] * middle \
            + ([last] if last else [])
    else:
        if L % (p * v):
            raise ValueError(f"--num-layers {L} is not divisible by pp*v = {p * v}; Megatron-LM "
                             "needs --pipeline-model-parallel-layout for uneven stages")
        return None
    bounds, start = [], 0
    for n in counts:
        bounds.append([start, start + n])
        start += n
    return bounds


def _recompute(flags: dict, ignored: list[str]) -> tuple[str, str | None, int | None]:
    """(granularity "none" | "full" | "selective", method, k) of the recompute flags."""
    granularity = flags.get("recompute-granularity")
    method = flags.get("recompute-method") or flags.get("activations-checkpoint-method")
    k = flags.get("recompute-num-layers") or flags.get("activations-checkpoint-num-layers")
    if granularity is None and flags.get("recompute-activations"):
        granularity = _CORE.frameworks["megatron"]
    if granularity is None and (flags.get("checkpoint-activations")
                                or "activations-checkpoint-method" in flags):
        granularity = _LAYER.frameworks["megatron"]
        ignored.append("--activations-checkpoint-method / --checkpoint-activations: the 2021 "
                       f"names, read as --recompute-granularity {granularity}")
    mode = recompute_mode_for("megatron", granularity or _NOTHING.frameworks["megatron"],
                              "--recompute-granularity")
    if mode.recomputes_layer and method not in ("uniform", "block"):
        raise ValueError(f"--recompute-granularity {granularity} needs --recompute-method "
                         f"uniform or block (got {method}); Megatron-LM refuses it without")
    if mode.recomputes_layer and method == "block" and k is None:
        raise ValueError("--recompute-method block needs --recompute-num-layers; Megatron-LM "
                         "refuses it without (TransformerConfig: recompute_num_layers must "
                         "be between 1 and the layers per stage)")
    return mode.name, method, k


def _refuse_unpriced(flags: dict, unknown: list[str]) -> None:
    """ValueError naming the first flag whose run autopar cannot price yet (all-to-all
    context parallelism, FSDP under Megatron-LM, FP8, selective recompute of modules other
    than core attention; MoE: :func:`~autopar.frameworks.megatron_moe.read_moe_flags`)."""
    for name, rule in _REFUSED.items():
        what = name in flags and rule(flags[name])
        if what:
            raise ValueError(f"--{name} {flags[name]}: {what} is not priced by autopar yet; "
                             "it would price another run than this script's, so it refuses it")
    fp8 = [flag for flag in unknown if flag.startswith("--fp8")]
    if fp8:
        raise ValueError(f"{fp8[0]}: FP8 training is not priced by autopar yet (it prices "
                         "bf16); drop the --fp8-* flags to price the bf16 run")
    modules = flags.get("recompute-modules")
    selective = flags.get("recompute-granularity") == _CORE.frameworks["megatron"] or (
        "recompute-granularity" not in flags and flags.get("recompute-activations"))
    if modules is not None and selective and modules != ["core_attn"]:
        raise ValueError(f"--recompute-modules {' '.join(modules)}: autopar prices selective "
                         "recompute of core attention only (Megatron-LM's default core_attn)")


def read_megatron_args(source: str, num_gpus: int | None = None) -> FrameworkRun:
    """The run Megatron-LM flags state (``source``: the flags, or a file holding them; see
    the module docstring). d = ``num_gpus`` / (t·p) when ``num_gpus`` is given, else None.
    Raises ValueError naming the flag: a missing ``--micro-batch-size`` or
    ``--num-layers``, an unsubstituted shell variable, a value Megatron-LM refuses (L not
    divisible by p without a layout, full recompute without a method), or GPUs not
    divisible by t·p."""
    flags, unknown = _flags(script_words(source))
    ignored = unknown
    _refuse_unpriced(flags, unknown)
    for need in ("micro-batch-size", "num-layers"):
        if need not in flags:
            raise ValueError(f"the Megatron-LM flags give no --{need}")
    t, p = flags.get("tensor-model-parallel-size", 1), flags.get("pipeline-model-parallel-size", 1)
    L, b = flags["num-layers"], flags["micro-batch-size"]
    c = flags.get("context-parallel-size", 1)
    if num_gpus is not None and num_gpus % (t * c * p):
        raise ValueError(f"{num_gpus} GPUs are not divisible by tp*cp*pp = {t}*{c}*{p}; give "
                         "the cluster the flags were written for")
    d = num_gpus // (t * c * p) if num_gpus is not None else None
    if c > 1 and flags.get("cp-comm-type", "p2p") == "p2p":  # Megatron-LM's default
        ignored.append(f"--cp-comm-type p2p (cp={c}): priced as all_gather, not overlapped")
    ep, moe = read_moe_flags(flags, t, d, ignored)
    v = flags.get("num-virtual-stages-per-pipeline-rank") or 1
    if "num-layers-per-virtual-pipeline-stage" in flags:
        per = flags["num-layers-per-virtual-pipeline-stage"]
        if L % (p * per):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per}: {L} layers do "
                             f"not split into pp={p} ranks of chunks of {per}")
        v = L // (p * per)
    counts = (parse_pp_layout(flags["pipeline-model-parallel-layout"], L, p)
              if "pipeline-model-parallel-layout" in flags else None)
    if counts is not None:  # p·v stages: the layout sets v
        v = len(counts) // p
    stages = _stages(flags, L, p, v, counts)
    granularity, method, k = _recompute(flags, ignored)
    recompute, per_layer = (granularity if not recompute_mode(granularity).recomputes_layer
                            or method == "uniform" else None), None
    if recompute is None:  # block: the first k layers of every chunk (Megatron-LM)
        chunks = stages or equal_chunks(L, p * v)
        per_layer = [_NOTHING.name] * L
        for lo, hi in chunks:
            for layer in range(lo, min(hi, lo + (k or 0))):
                per_layer[layer] = _LAYER.name
    dtype = "bf16" if flags.get("bf16") or flags.get("fp16") else "fp32"
    attention = _attention(flags.get("attention-backend", "auto"), dtype)
    # arguments.py validate_args: under --bf16, fp32 main grads reduced in fp32 unless
    # --grad-reduce-in-bf16 or --main-grads-dtype bf16; --fp16 keeps fp16 ones unless
    # --accumulate-allreduce-grads-in-fp32
    fp32_grads = bool(flags.get("accumulate-allreduce-grads-in-fp32")) or bool(
        flags.get("bf16") and not flags.get("grad-reduce-in-bf16")
        and flags.get("main-grads-dtype", "fp32") == "fp32")
    grad_dtype = "fp32" if dtype == "fp32" or fp32_grads else "bf16"
    if flags.get("fp16"):
        ignored.append("--fp16: priced as bf16 (the same bytes and tensor-core peak)")
    sp = bool(flags.get("sequence-parallel")) and t > 1
    layout = Layout(tp=t, pp=p, dp=d, micro_batch_size=b,
                    zero_stage=1 if flags.get("use-distributed-optimizer") else 0,
                    recompute=recompute, schedule=default_schedule(v).name,
                    virtual_stages=v, sequence_parallel=sp, dtype=dtype, grad_dtype=grad_dtype,
                    ep=ep, cp=c)
    h = flags.get("hidden-size")
    shape = {"num_layers": L, "hidden_size": h,
             "num_attention_heads": flags.get("num-attention-heads"),
             # arguments.py: 4h, or with --swiglu 8h/3 rounded down to a multiple of 64
             "ffn_hidden_size": flags.get("ffn-hidden-size") or (
                 None if h is None else int(4 * h * 2 / 3 / 64) * 64 if flags.get("swiglu")
                 else 4 * h),
             # counted only with --group-query-attention (arguments.py)
             "num_query_groups": flags.get("num-query-groups")
             if flags.get("group-query-attention") else None,
             "seq_length": flags.get("max-position-embeddings") or flags.get("seq-length"),
             "vocab_size": flags.get("padded-vocab-size") or flags.get("vocab-size"),
             "swiglu": bool(flags.get("swiglu")),
             "dropout": flags.get("hidden-dropout", 0.1),  # Megatron-LM's default
             "untied": bool(flags.get("untie-embeddings-and-output-weights")), **moe}
    if "num-query-groups" in flags and not flags.get("group-query-attention"):
        ignored.append(f"--num-query-groups {flags['num-query-groups']}: without --group-query-"
                       "attention Megatron-LM keeps a key/value head per query head, priced so")
    if shape["vocab_size"] is None and any(w.startswith("--vocab-file") for w in unknown):
        multiple = flags.get("make-vocab-size-divisible-by", 128) * t
        shape["vocab_size"] = pad_vocab_size(50257, multiple)
        ignored.append(f"--vocab-file: GPT-2's 50,257 tokens padded to {shape['vocab_size']} "
                       "(--make-vocab-size-divisible-by x tp, as Megatron-LM pads)")
    batch = flags.get("global-batch-size") or (d * b if d else None)
    return FrameworkRun("megatron", layout, stages, per_layer,
                        {k2: val for k2, val in shape.items() if val is not None}, batch,
                        flags.get("seq-length"), ignored, attention)


def megatron_args(plan) -> list[str]:
    """The Megatron-LM flags that run ``plan`` (a :class:`~autopar.contract.plan.Plan`): model shape,
    its MoE layers and expert parallelism (:mod:`~autopar.frameworks.megatron_moe`),
    parallel sizes, batch, pipeline split, recompute, optimizer sharding, precision and the
    attention kernel priced (``--attention-backend flash`` or ``unfused``:
    :data:`ATTENTION_BACKENDS`), in that order. Raises ValueError when the plan is outside Megatron-LM's space
    (:func:`~autopar.frameworks.targets.outside_target`)."""
    problem = outside_target(plan, "megatron") or moe_plan_problem(plan)
    if problem:
        raise ValueError(problem)
    shape = model_shape(plan.model_config)
    out = ["--num-layers", str(shape["num_layers"]), "--hidden-size", str(shape["hidden_size"]),
           "--num-attention-heads", str(shape["num_attention_heads"]),
           "--ffn-hidden-size", str(shape["ffn_hidden_size"])]
    if shape["num_query_groups"] != shape["num_attention_heads"]:
        out += ["--group-query-attention", "--num-query-groups", str(shape["num_query_groups"])]
    if shape["swiglu"]:
        out += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--disable-bias-linear"] + _rotary_base(shape.get("rope_theta"))
    out += ["--untie-embeddings-and-output-weights"] * shape["untied"]
    out += moe_model_args(plan.model_config)  # [] for a dense model
    out += ["--seq-length", str(plan.seq_len), "--max-position-embeddings",
            str(shape.get("seq_length") or plan.seq_len), "--vocab-size", str(shape["vocab_size"]),
            "--hidden-dropout", f"{shape.get('dropout', 0.0):g}",
            "--attention-dropout", f"{shape.get('dropout', 0.0):g}",
            "--tensor-model-parallel-size", str(plan.tp),
            "--pipeline-model-parallel-size", str(plan.pp)] + moe_parallel_args(plan)
    if plan.cp > 1:  # Megatron-Core's all-gather CP, as priced
        out += ["--context-parallel-size", str(plan.cp), "--cp-comm-type", "all_gather"]
    sp = tensor_parallel_mode(plan.sequence_parallel)  # its flag beside --tensor-model-...
    out += [sp.frameworks["megatron"]] * sp.shards_sequence + ["--micro-batch-size", str(
        plan.micro_batch_size), "--global-batch-size", str(plan.global_batch_size)]
    L, v = len(plan.recompute), plan.virtual_stages
    if v > 1:
        out += ["--num-layers-per-virtual-pipeline-stage", str(L // (plan.pp * v))]
    elif plan.stage_layers != (equal_chunks(L, plan.pp) if L % plan.pp == 0 else None):
        counts = [hi - lo for lo, hi in plan.stage_layers]
        out += ["--pipeline-model-parallel-layout", pp_layout(counts)]
    modes = set(plan.recompute)
    if modes == {_CORE.name}:
        out += ["--recompute-granularity", _CORE.frameworks["megatron"]]
    elif modes == {_LAYER.name}:
        out += ["--recompute-granularity", _LAYER.frameworks["megatron"], "--recompute-method",
                "uniform", "--recompute-num-layers", "1"]
    elif _LAYER.name in modes:
        k = megatron_block_layers(plan.recompute, plan.stage_layers)
        out += ["--recompute-granularity", _LAYER.frameworks["megatron"], "--recompute-method",
                "block", "--recompute-num-layers", str(k)]
    zero = zero_stage(plan.zero_stage)  # the distributed optimizer when it shards
    out += [zero.frameworks["megatron"]] if zero.shards_optimizer else []
    if plan.dtype == "bf16":
        out += ["--bf16"] + ["--grad-reduce-in-bf16"] * (plan_grad_dtype(plan) == "bf16")
    out += ["--attention-backend", "flash" if plan.attention_kernel == "flash" else "unfused"]
    return out


def _rotary_base(theta) -> list[str]:
    """``--rotary-base`` for a rope theta other than Megatron-LM's default 10000 (an int,
    arguments.py L1655 at core_v0.16.1); ValueError otherwise."""
    if theta is None or theta == 10000:
        return []
    if theta != int(theta):
        raise ValueError(f"rope_theta {theta}: Megatron-LM's --rotary-base is an integer")
    return ["--rotary-base", str(int(theta))]


def format_megatron_args(plan) -> str:
    """:func:`megatron_args` as a launch fragment: a comment naming the plan and the GPUs,
    the environment the launch needs (``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron-LM's
    ``validate_args`` requires with tp > 1 on GPUs before Blackwell, arguments.py L927-952
    at core_v0.16.1, and its example scripts export), the ``torchrun`` line, then one flag
    (with its value) per line, continued with backslashes."""
    args, lines, i = megatron_args(plan), [], 0
    while i < len(args):
        takes = i + 1 < len(args) and not args[i + 1].startswith("--")
        lines.append(" ".join(shlex.quote(a) for a in args[i:i + 1 + takes]))
        i += 1 + takes
    head = (f"# autopar plan for {plan.model} on {plan.num_gpus} GPUs "
            f"(tp={plan.tp}" + (f" cp={plan.cp}" if plan.cp > 1 else "") + f" pp={plan.pp} "
            f"dp={plan.dp}" + (f" ep={plan.ep}" if plan.ep > 1 else "") + "): predicted step "
            f"{plan.predicted.step_time_s:.3f} s\n"
            + ("# export CUDA_DEVICE_MAX_CONNECTIONS=1\n" if plan.tp > 1 else "")
            + f"# {torchrun_line(plan)} pretrain_gpt.py \\\n")
    return head + " \\\n".join(f"    {line}" for line in lines) + "\n"
