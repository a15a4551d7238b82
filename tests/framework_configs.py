"""Hand a parallel configuration to the frameworks' own configuration code.

autopar emits configurations for Megatron-LM, torchtitan and DeepSpeed; the functions here
show that such a configuration is accepted by the code those frameworks use to read it, on
CPU and without a process group of the real size. Each one returns the framework's parsed
object and raises whatever the framework raises when it rejects the configuration.

The pinned versions (megatron-core 0.16.1, torchtitan 0.2.2, deepspeed 0.19.8) are
installed next to torch 2.13.0 CPU by ``tests/install_frameworks.sh``.

- Megatron: :func:`megatron_config` builds megatron-core's ``TransformerConfig`` (which
  subclasses ``ModelParallelConfig``) and asks megatron-core how many decoder layers each
  pipeline stage builds; :func:`megatron_fields_from_flags` turns Megatron-LM command-line
  flags into those fields the way ``megatron/training/arguments.py`` does (the wheel has no
  ``megatron.training``); :func:`megatron_microbatches` is megatron-core's microbatch count.
- torchtitan 0.2.2 (the last release with job TOML files: 0.3.0 replaced them by Python
  config registries): :func:`torchtitan_config` runs its ``ConfigManager`` on a TOML and,
  given the world size, its own mesh and pipeline-split checks.
- DeepSpeed: :func:`deepspeed_config` builds ``deepspeed.runtime.config.DeepSpeedConfig``
  with the data-parallel world size a real run would give it.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Sequence

import torch

# Megatron-LM's dtype flags (arguments.py, validate_args: "Parameters dtype").
_MEGATRON_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------
# Megatron (megatron-core 0.16.1; Megatron-LM's arguments.py at tag core_v0.16.1)
# --------------------------------------------------------------------------------------

def megatron_config(fields: dict[str, Any]):
    """megatron-core's ``TransformerConfig`` built from ``fields``, its keyword arguments.

    ``fields`` uses the dataclass's own names (``tensor_model_parallel_size``,
    ``pipeline_model_parallel_size``, ``virtual_pipeline_model_parallel_size``,
    ``sequence_parallel``, ``recompute_granularity``, ``recompute_method``,
    ``recompute_num_layers``, ``num_layers``, ``hidden_size``, ``num_attention_heads``,
    ``ffn_hidden_size``, ``num_query_groups``, ``bf16``/``fp16``/``params_dtype``,
    ``num_layers_in_first_pipeline_stage``/``num_layers_in_last_pipeline_stage`` or
    ``pipeline_model_parallel_layout``, ...); an unknown name is a ``TypeError``. As
    Megatron-LM does, a missing ``params_dtype`` follows ``bf16``/``fp16`` and
    ``pipeline_dtype`` defaults to ``params_dtype`` (``__post_init__`` requires it with
    pipeline parallelism).

    ``TransformerConfig.__post_init__`` raises (``ValueError`` or ``AssertionError``) on what
    it rejects; then every (pipeline rank, virtual stage) is asked for its decoder-layer
    count (:func:`megatron_stage_layers`), which is where megatron-core checks an even split
    (``num_layers`` divisible by the pipeline size, per-rank layers by the virtual size).
    Runs on CPU with no process group.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(fields)
    if "params_dtype" not in kwargs:
        kwargs["params_dtype"] = (torch.bfloat16 if kwargs.get("bf16") else
                                  torch.float16 if kwargs.get("fp16") else torch.float32)
    kwargs.setdefault("pipeline_dtype", kwargs["params_dtype"])
    config = TransformerConfig(**kwargs)
    megatron_stage_layers(config)
    return config


def megatron_stage_layers(config) -> list[list[int]]:
    """Decoder layers per stage, ``[pipeline rank][virtual stage]``, as megatron-core builds them.

    Without a layout this is megatron-core's ``get_num_layers_to_build`` (the function
    ``TransformerBlock`` calls), which asserts the even-split rules; with
    ``pipeline_model_parallel_layout`` it is the decoder count of each parsed layout stage.
    """
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return [[stage.count(LayerType.decoder) for stage in row] for row in layout.layout]
    pp = config.pipeline_model_parallel_size
    vp = config.virtual_pipeline_model_parallel_size if pp > 1 else None
    return [[get_num_layers_to_build(config, vp_stage=(v if vp else None), pp_rank=r)
             for v in range(vp or 1)] for r in range(pp)]


def _megatron_flag_parser():
    """The Megatron-LM flags :func:`megatron_fields_from_flags` reads, as arguments.py declares them."""
    import argparse

    p = argparse.ArgumentParser(prog="megatron", add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers",
                 "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
                 "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--recompute-num-layers", "--micro-batch-size", "--global-batch-size", "--seq-length"):
        p.add_argument(flag, type=int)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a", "a2a+p2p"],
                   default="p2p")
    for flag in ("--vocab-size", "--max-position-embeddings",  # GPTModel's, not the config's
                 "--rotary-base"):
        p.add_argument(flag, type=int)
    for flag in ("--hidden-dropout", "--attention-dropout"):
        p.add_argument(flag, type=float)
    for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                 "--moe-shared-expert-intermediate-size", "--expert-model-parallel-size",
                 "--expert-tensor-parallel-size"):  # arguments.py _add_moe_args, parallel args
        p.add_argument(flag, type=int)
    p.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"])
    p.add_argument("--moe-layer-freq", type=str)  # moe_freq_type: an int or a list expression
    for flag in ("--moe-grouped-gemm", "--moe-router-pre-softmax", "--moe-shared-expert-gate"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"])
    p.add_argument("--pipeline-model-parallel-layout", type=str)
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    # arguments.py generates it from TransformerConfig: type=lambda name: AttnBackend[name]
    p.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"],
                   default="auto")
    for flag in ("--sequence-parallel", "--bf16", "--fp16", "--group-query-attention",
                 "--recompute-activations", "--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split", "--use-distributed-optimizer",
                 "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--grad-reduce-in-bf16"):
        p.add_argument(flag, action="store_true")
    return p


def megatron_fields_from_flags(argv: Sequence[str]) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments for Megatron-LM command-line flags.

    Follows Megatron-LM's ``megatron/training/arguments.py`` at tag core_v0.16.1
    (``validate_args`` and ``core_transformer_config_from_args``): most flags are the field
    name with ``-`` for ``_`` (the ``TransformerConfig`` argument group is generated from the
    dataclass); ``--decoder-first/last-pipeline-num-layers`` become
    ``num_layers_in_first/last_pipeline_stage``; ``--num-layers-per-virtual-pipeline-stage
    L`` becomes ``virtual_pipeline_model_parallel_size = (num_layers / pp) / L`` and
    ``--num-virtual-stages-per-pipeline-rank V`` becomes ``V`` (a result of 1 means None);
    a layout fixes it to ``stages / pp``; ``--recompute-activations`` means selective;
    ``--num-query-groups`` counts only with ``--group-query-attention``; ``--bf16``/``--fp16``
    set ``params_dtype`` and ``pipeline_dtype``; sequence parallelism is dropped at tp = 1.
    Arguments.py's own asserts on these steps raise ``AssertionError`` here too.

    Only the flags of :func:`_megatron_flag_parser` are known (another is an
    ``argparse.ArgumentError``); ``--use-distributed-optimizer``, ``--micro-batch-size``,
    ``--global-batch-size``, ``--seq-length``, ``--vocab-size``, ``--max-position-embeddings``,
    ``--rotary-base``,
    ``--grad-reduce-in-bf16``,
    ``--position-embedding-type`` and ``--untie-embeddings-and-output-weights`` are read but
    belong to other configs (``DistributedDataParallelConfig``/``OptimizerConfig``, the
    microbatch calculator, ``GPTModel``); ``--swiglu`` sets ``gated_linear_unit`` and SiLU,
    ``--disable-bias-linear`` ``add_bias_linear=False``, the dropouts their fields,
    ``--attention-backend`` the ``AttnBackend`` of its name.
    """
    from megatron.core.transformer.enums import AttnBackend

    args, unknown = _megatron_flag_parser().parse_known_args(list(argv))
    if unknown:
        raise ValueError(f"flags megatron_fields_from_flags does not know: {unknown}")
    pp = args.pipeline_model_parallel_size or 1
    tp = args.tensor_model_parallel_size or 1
    assert sum(x is not None for x in (args.num_layers_per_virtual_pipeline_stage,
                                       args.num_virtual_stages_per_pipeline_rank,
                                       args.pipeline_model_parallel_layout)) <= 1, (
        "No more than one of --num-layers-per-virtual-pipeline-stage, "
        "--num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout")
    vp = None
    if args.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
        stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)
        assert stages % pp == 0, "The length of pipeline_model_parallel_layout must be divisible by pp"
        vp = stages // pp
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        vp = args.num_virtual_stages_per_pipeline_rank
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        assert args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None, (
            "please use --num-virtual-stages-per-pipeline-rank with uneven pipeline parallelism")
        layers = (args.num_layers + int(args.account_for_embedding_in_pipeline_split)
                  + int(args.account_for_loss_in_pipeline_split))
        assert layers % pp == 0, "number of layers of the model must be divisible pipeline model parallel size"
        assert (layers // pp) % args.num_layers_per_virtual_pipeline_stage == 0, (
            "number of layers per pipeline stage must be divisible number of layers per virtual pipeline stage")
        vp = layers // pp // args.num_layers_per_virtual_pipeline_stage
    if vp == 1:
        vp = None
    assert not (args.bf16 and args.fp16)
    dtype = _MEGATRON_DTYPES["bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"]
    granularity = "selective" if args.recompute_activations else args.recompute_granularity
    fields: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vp,
        "sequence_parallel": args.sequence_parallel and tp > 1,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size,
        "num_query_groups": args.num_query_groups if args.group_query_attention else None,
        "recompute_granularity": granularity,
        "recompute_method": args.recompute_method,
        "recompute_num_layers": args.recompute_num_layers,
        "num_layers_in_first_pipeline_stage": args.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": args.decoder_last_pipeline_num_layers,
        "pipeline_model_parallel_layout": args.pipeline_model_parallel_layout,
        "account_for_embedding_in_pipeline_split": args.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": args.account_for_loss_in_pipeline_split,
        "bf16": args.bf16,
        "fp16": args.fp16,
        "normalization": args.normalization,
        "gated_linear_unit": args.swiglu,  # arguments.py: --swiglu -> a SiLU-gated MLP
        "add_bias_linear": not args.disable_bias_linear,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "attention_backend": AttnBackend[args.attention_backend],
        "context_parallel_size": args.context_parallel_size,
        "cp_comm_type": args.cp_comm_type,
    }
    if args.swiglu:
        fields["activation_func"] = torch.nn.functional.silu
    fields |= _megatron_moe_fields(args)
    for name in ("hidden_dropout", "attention_dropout"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    return fields


def _megatron_moe_fields(args) -> dict[str, Any]:
    """The MoE ``TransformerConfig`` fields of parsed flags ``args``, with Megatron-LM's
    asserts (arguments.py ``validate_args`` at core_v0.16.1, L1024-1027 "Expert parallelism
    check"); {} without ``--num-experts`` and EP."""
    ep = args.expert_model_parallel_size or 1
    if args.num_experts is None:
        assert ep == 1, "num_experts must be non None to use expert model parallelism"
        return {}
    assert args.num_experts % ep == 0, \
        "Number of experts should be a multiple of expert model parallel_size."
    freq = args.moe_layer_freq or "1"  # moe_freq_type: a list expression, else an int
    fields = {"num_moe_experts": args.num_experts, "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
              "moe_router_topk": args.moe_router_topk or 2,
              "moe_layer_freq": eval(freq) if "[" in freq else int(freq),  # noqa: S307
              "moe_grouped_gemm": args.moe_grouped_gemm,
              "moe_router_pre_softmax": args.moe_router_pre_softmax,
              "moe_shared_expert_intermediate_size": args.moe_shared_expert_intermediate_size,
              "moe_shared_expert_gate": args.moe_shared_expert_gate,
              "expert_model_parallel_size": ep,
              "expert_tensor_parallel_size": args.expert_tensor_parallel_size}
    if args.moe_token_dispatcher_type:
        fields["moe_token_dispatcher_type"] = args.moe_token_dispatcher_type
    return fields


def megatron_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Microbatches per step by megatron-core's ``ConstantNumMicroBatchesCalculator``.

    Raises ``AssertionError`` unless ``global_batch_size`` is a positive multiple of
    ``micro_batch_size * data_parallel_size`` (Megatron-LM's ``--global-batch-size``,
    ``--micro-batch-size``; data-parallel size = world / (tp * pp * cp)).
    """
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    calc = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                             decrease_batch_size_if_needed=False, rank=0)
    return calc.get()


# --------------------------------------------------------------------------------------
# torchtitan 0.2.2 (the last release that reads job TOML files; 0.3.0 has none)
# --------------------------------------------------------------------------------------

def torchtitan_config(toml_text: str, world_size: int | None = None):
    """torchtitan's ``JobConfig`` for a job TOML, parsed by torchtitan 0.2.2's own
    ``ConfigManager().parse_args(["--job.config_file", path])`` (what ``torchtitan.train``
    runs): it refuses an unknown section or field and a value of the wrong type (not the
    value of a string choice such as ``activation_checkpoint.mode``).

    With ``world_size``, the start-up checks of torchtitan that need no devices run too,
    by torchtitan's code where it has a function for them: ``ParallelDims`` (``dp_replicate
    * dp_shard * cp * tp * pp == world_size``), the schedule name
    (``get_schedule_class``), and with pipeline parallelism the rules ``pipeline_llm`` and
    ``build_pipeline_schedule`` apply: the model chunks of :func:`torchtitan_stage_modules`
    divisible by pp, one per rank for a single-stage schedule and at least two for a looped
    one, ``local_batch_size`` divisible by ``pipeline_parallel_microbatch_size``.
    """
    import os
    import tempfile

    from torchtitan.config import ConfigManager

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml_text)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            config = ConfigManager().parse_args(["--job.config_file", f.name])
    except SystemExit as e:
        raise ValueError(f"torchtitan rejected the job TOML:\n{err.getvalue()}") from e
    finally:
        os.unlink(f.name)
    if world_size is not None:
        torchtitan_stage_modules(config, world_size)
    return config


def torchtitan_stage_modules(config, world_size: int) -> list[list[str]]:
    """Module names of each model chunk (chunk c on pipeline rank c % pp), as torchtitan
    0.2.2's ``pipeline_llm`` takes them: ``parallelism.module_fqns_per_model_part``, else
    its own split (``generate_llm_fqn_per_model_part`` of the schedule's default chunk
    count, with the model's layer count from its flavor). Raises what torchtitan raises
    (``ParallelDims``: AssertionError; an unknown schedule: ValueError) and ValueError for
    the chunk rules in :func:`torchtitan_config`'s docstring."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    par = config.parallelism
    dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree,
                        dp_shard=par.data_parallel_shard_degree, cp=par.context_parallel_degree,
                        tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                        ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree,
                        world_size=world_size)
    parts = par.module_fqns_per_model_part
    if dims.pp == 1:
        return parts or [["tok_embeddings", "layers", "norm", "output"]]
    single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
    if parts is None:
        from torchtitan.protocols.train_spec import get_train_spec

        layers = get_train_spec(config.model.name).model_args[config.model.flavor].n_layers
        parts = generate_llm_fqn_per_model_part(dims.pp * (1 if single else 2), layers)
    per_rank, rest = divmod(len(parts), dims.pp)
    if rest or (single and per_rank != 1) or (not single and per_rank < 2):
        raise ValueError(f"{len(parts)} model chunks on pp={dims.pp} ranks: "
                         f"{par.pipeline_parallel_schedule} runs "
                         f"{'one chunk' if single else 'two or more chunks'} per rank")
    if config.training.local_batch_size % par.pipeline_parallel_microbatch_size:
        raise ValueError(f"Batch size {config.training.local_batch_size} must be divisible by "
                         f"microbatch_size {par.pipeline_parallel_microbatch_size}")
    return parts


# --------------------------------------------------------------------------------------
# DeepSpeed 0.19.8
# --------------------------------------------------------------------------------------

class _DataParallelMpu:
    """The Megatron-style ``mpu`` DeepSpeedConfig asks for its world size (only this method)."""

    def __init__(self, data_parallel_size: int):
        self._dp = data_parallel_size

    def get_data_parallel_world_size(self) -> int:
        return self._dp


def deepspeed_config(config: dict, world_size: int, pipeline_parallel_size: int = 1,
                     tensor_parallel_size: int = 1):
    """DeepSpeed's ``DeepSpeedConfig`` for ``config`` in a run of ``world_size`` ranks.

    DeepSpeed checks ``train_batch_size == train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * W`` (filling in a missing one of the three), where W is
    ``mpu.get_data_parallel_world_size()``: under pipeline parallelism ``deepspeed.initialize``
    passes the ``PipelineModule``'s grid, whose data-parallel size is world / (pp * tp)
    (DeepSpeed's ``PipeModelDataParallelTopology``, used here to compute it). The ``pipeline``
    section is parsed as a plain dict (unknown keys kept); ``zero_optimization`` and the
    other pydantic sections reject unknown keys and bad values.

    DeepSpeedConfig reads W only once ``deepspeed.comm`` is initialised (otherwise it
    silently uses 1), so a one-rank gloo group on an in-memory store is started for the
    call and destroyed after it, unless the caller already has one. With the CPU
    accelerator that needs DeepSpeed's shm comm op, which the install script prebuilds.
    """
    import torch.distributed as tdist
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    model = pipeline_parallel_size * tensor_parallel_size
    if world_size % model:
        raise ValueError(f"world size {world_size} is not a multiple of pp * tp = {model}")
    topology = PipeModelDataParallelTopology(num_pp=pipeline_parallel_size, num_mp=tensor_parallel_size,
                                             num_dp=world_size // model)
    mpu = _DataParallelMpu(topology.get_dim("data"))
    started = not tdist.is_initialized()
    if started:
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        return DeepSpeedConfig(config, mpu=mpu)
    finally:
        if started:
            tdist.destroy_process_group()
