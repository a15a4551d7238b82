"""Hand a parallel configuration to the frameworks' own START-UP code, on CPU.

:mod:`framework_configs` shows that what autopar emits is accepted by each framework's
configuration parser; the functions here go further, through the code each framework runs
when a job starts, as far as that code runs without a GPU: on a fake process group of the
plan's world size (``torch.testing._internal.distributed.fake_pg``: every collective is a
no-op, so one process plays rank ``rank`` of ``world_size``), destroyed after each call so
that calls can follow one another in one process. Each function raises whatever the
framework raises when it refuses the configuration, and returns what the framework built.

- torchtitan 0.2.2: :func:`torchtitan_startup` runs ``Trainer.__init__``'s model path
  (``torchtitan/train.py``): ``ParallelDims`` and its device mesh, the llama3
  ``Transformer`` on the meta device, ``pipeline_llm`` or ``parallelize_llama``, weight
  initialisation, the DDP constructor, ``build_optimizers`` and ``maybe_enable_amp``.
- Megatron (megatron-core 0.16.1): :func:`megatron_startup` runs
  ``parallel_state.initialize_model_parallel`` (Megatron-LM's ``_initialize_distributed``),
  the micro-batch calculator, ``TransformerConfig`` and ``DistributedDataParallelConfig``.
- DeepSpeed 0.19.8: :func:`deepspeed_startup` runs ``deepspeed.initialize`` itself (the
  whole ``DeepSpeedEngine`` / ``PipelineEngine`` constructor, ZeRO optimizer included) on a
  tiny model, a ``PipelineModule`` with pipelining.

Patches (all undone on return): torchtitan's ``device_type`` is "cpu" while its mesh is
built (it is "cuda" on a machine without an accelerator); megatron-core is asked for no gloo
side groups (``create_gloo_process_groups=False``); DeepSpeed gets ``LOCAL_RANK=0`` in the
environment (``PipelineModule`` reads it). Nothing else is patched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
import shlex
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple
from unittest import mock

import torch

import framework_configs as fc


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0,
                       destroy: Callable[[], None] | None = None) -> Iterator[None]:
    """torch.distributed's default group on the fake backend (``FakeStore``), ``rank`` of
    ``world_size``, for the duration of the block; destroyed after it by ``destroy`` (default
    ``torch.distributed.destroy_process_group``), which also ends every sub-group made in it.
    RuntimeError if a default group already exists (a check leaking one would otherwise
    hand the next its world size)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised; destroy it first")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            (destroy or dist.destroy_process_group)()


# --------------------------------------------------------------------------------------
# torchtitan 0.2.2
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class TorchtitanStartup:
    """What torchtitan built on one rank (:func:`torchtitan_startup`)."""

    job_config: Any
    parallel_dims: Any  # torchtitan.distributed.ParallelDims, its mesh built
    model_args: Any  # TransformerModelArgs after update_from_config
    model_parts: list  # the parallelized model (pp = 1) or this rank's pipeline chunks
    stage_indices: list[int]  # pipeline stage of each part ([0] without pipelining)
    schedule: Any  # torch.distributed.pipelining schedule (pp > 1), else None
    data_parallel: str | None  # "fsdp" (fully_shard), "ddp" (replicate) or None
    mp_policy: Any  # FSDP's MixedPrecisionPolicy on every TransformerBlock, or None
    autocast_dtype: torch.dtype | None  # maybe_enable_amp's autocast dtype; None: AMP off
    gradient_accumulation_steps: int
    optimizers: Any  # torchtitan's OptimizersContainer
    logits_shape: tuple | None  # the first forward's output shape (forward=True), else None


def _composable(module) -> set[str]:
    """The composable APIs applied to ``module`` ("fully_shard", "replicate")."""
    from torch.distributed._composable.contract import _get_registry

    return set(_get_registry(module) or ())


def torchtitan_startup(toml_text: str, model_args: dict, world_size: int,
                       rank: int = 0, forward: bool = False) -> TorchtitanStartup:
    """torchtitan 0.2.2's start-up (``torchtitan/train.py``, ``Trainer.__init__``) for the
    job TOML ``toml_text``, with the llama3 model of ``TransformerModelArgs(**model_args)``
    (``autopar.frameworks.torchtitan.torchtitan_model_args``: the emitted TOML names a
    flavor, "autopar", that is registered by hand), as rank ``rank`` of ``world_size``.

    Runs, in ``Trainer.__init__``'s order: ``ConfigManager().parse_args`` on the TOML
    (:func:`framework_configs.torchtitan_config`); ``init_distributed``'s ``ParallelDims``
    (AssertionError unless the degrees multiply to the world size) and its ``build_mesh``
    (``distributed/parallel_dims.py``, unflattening the world into pp/batch/fsdp/tp/...
    meshes, each size validated); ``model_args.update_from_config``; the model on the meta
    device in ``training.dtype``; ``build_cross_entropy_loss``; the batch checks (a copy of
    train.py's inline asserts: global batch a positive multiple of local batch x
    data-parallel degree, which gives the accumulation steps); then with pp > 1
    ``pipeline_llm`` (``distributed/pipeline_parallel.py``: ``pipeline_module_split`` into
    this rank's chunks of ``module_fqns_per_model_part``, each a ``PipelineStage`` on CPU,
    each chunk through ``parallelize_llama``, then ``build_pipeline_schedule``, which
    refuses a local batch not divisible by the micro-batch), else ``parallelize_llama``
    (``models/llama3/infra/parallelize.py``: seq_len divisible by tp·2·cp, ``apply_tp``,
    ``apply_ac``, ``apply_fsdp`` with ``MixedPrecisionPolicy(mixed_precision_param,
    mixed_precision_reduce)`` on every TransformerBlock, or ``apply_ddp``, which refuses
    DDP on a mesh larger than its own, "DDP has not supported > 1D parallelism"); every
    part ``to_empty`` on CPU and ``init_weights`` (DTensor initialisation on the fake
    mesh); under DDP, ``replicate``'s deferred ``DistributedDataParallel`` constructor
    (it runs at the first forward: ``replicate.state(m).lazy_init()``);
    ``build_optimizers``; ``maybe_enable_amp`` (autocast only without FSDP, TP and PP).
    With ``forward`` (pp = 1 only), one step further than start-up: the first forward of a
    local batch of random tokens through the parallelized model under that autocast (as
    ``train_step`` runs it; the fake collectives return tensors of the right shapes), which
    is where a head split torchtitan accepted at start-up can still fail (e.g. ``tp`` not
    dividing ``n_kv_heads``: "shape ... is invalid for input of size ...").

    Patched: ``torchtitan.distributed.parallel_dims.device_type`` is "cpu" while the mesh
    is built (torchtitan's ``get_device_info`` answers "cuda" when no accelerator is
    found), and the device handed to ``pipeline_llm``, ``to_empty`` and
    ``maybe_enable_amp`` is CPU. torch.compile stays off (the TOML does not enable it).

    Not run (needs a GPU or files): ``device_module.set_device(cuda:LOCAL_RANK)``, the
    tokenizer and dataloader (HF assets and a dataset), the metrics processor and device
    memory monitor (CUDA memory stats, peak FLOPS), the ``CheckpointManager``, validation,
    and the training loop.
    """
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.distributed.utils import maybe_enable_amp
    from torchtitan.models.llama3 import (
        Transformer,
        TransformerModelArgs,
        parallelize_llama,
    )
    from torchtitan.tools.utils import set_default_dtype

    job_config = fc.torchtitan_config(toml_text)
    cpu = torch.device("cpu")
    with (fake_process_group(world_size, rank), warnings.catch_warnings(),
          torch.random.fork_rng(devices=[])):  # init_weights draws from the CPU generator
        # parallelize_module warns for each plan entry a pipeline chunk has deleted (None)
        warnings.filterwarnings("ignore", message="(?s).*skipping this plan entry")
        warnings.filterwarnings("ignore", message="DTensor random operators")
        par = job_config.parallelism
        with mock.patch.object(parallel_dims_module, "device_type", "cpu"):
            dims = ParallelDims(dp_shard=par.data_parallel_shard_degree,
                                dp_replicate=par.data_parallel_replicate_degree,
                                cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                                pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                                etp=par.expert_tensor_parallel_degree,
                                world_size=dist.get_world_size())
            dims.build_mesh()
        batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1

        args = TransformerModelArgs(**model_args)
        args.update_from_config(job_config)  # max_seq_len = training.seq_len
        with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]):
            model = Transformer(args)
        loss_fn = build_cross_entropy_loss(job_config, parallel_dims=dims)

        # train.py, "verify batch sizes" (inline there, so repeated here)
        training = job_config.training
        global_batch = training.global_batch_size
        if global_batch < 0:
            global_batch = training.local_batch_size * batch_degree
        assert global_batch > 0
        assert global_batch % (training.local_batch_size * batch_degree) == 0, (
            f"global batch size must be multiple of local batch size times data-parallel "
            f"degree ({global_batch} % ({training.local_batch_size} * {batch_degree}) != 0)")
        accumulation = global_batch // (training.local_batch_size * batch_degree)
        assert accumulation > 0

        schedule = None
        if dims.pp_enabled:
            schedule, parts, _, _ = pipeline_llm(model, dims, job_config, cpu, args,
                                                 parallelize_llama, loss_fn)
            stages = getattr(schedule, "_stages", None) or [schedule._stage]
            indices = [stage.stage_index for stage in stages]
        else:
            parts, indices = [parallelize_llama(model, dims, job_config)], [0]
        for part in parts:
            part.to_empty(device=cpu)
            with torch.no_grad():
                part.init_weights(buffer_device=None)
            part.train()
            if "replicate" in _composable(part):
                replicate.state(part).lazy_init()  # DistributedDataParallel(...)
        optimizers = build_optimizers(parts, job_config.optimizer, dims)
        amp = maybe_enable_amp(dims, training.mixed_precision_param, "cpu")
        logits_shape = None
        if forward:
            if dims.pp_enabled:
                raise ValueError("forward=True runs the pp = 1 model only")
            tokens = torch.randint(0, args.vocab_size, (training.local_batch_size, training.seq_len))
            with amp:
                logits_shape = tuple(parts[0](tokens).shape)

    blocks = [block for part in parts for block in part.layers.values()]
    applied = set.union(*(_composable(m) for part in parts for m in part.modules()))
    data_parallel = ("fsdp" if "fully_shard" in applied else
                     "ddp" if "replicate" in applied else None)
    policies = {repr(fully_shard.state(b)._mp_policy) for b in blocks
                if "fully_shard" in _composable(b)}
    mp_policy = None
    if data_parallel == "fsdp":
        if len(policies) != 1 or not all("fully_shard" in _composable(b) for b in blocks):
            raise AssertionError(f"FSDP did not wrap every TransformerBlock alike: {policies}")
        mp_policy = fully_shard.state(blocks[0])._mp_policy
    return TorchtitanStartup(
        job_config=job_config, parallel_dims=dims, model_args=args, model_parts=parts,
        stage_indices=indices, schedule=schedule, data_parallel=data_parallel,
        mp_policy=mp_policy,
        autocast_dtype=amp.fast_dtype if isinstance(amp, torch.autocast) else None,
        gradient_accumulation_steps=accumulation, optimizers=optimizers,
        logits_shape=logits_shape)


# --------------------------------------------------------------------------------------
# Megatron (megatron-core 0.16.1; Megatron-LM's arguments.py/training.py at core_v0.16.1)
# --------------------------------------------------------------------------------------

def megatron_argv(text: str) -> list[str]:
    """The flags of an emitted Megatron-LM launch fragment: comment lines dropped,
    backslash continuations joined, then split as the shell would."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return shlex.split(" ".join(lines).replace("\\", " "))


class MegatronStartup(NamedTuple):
    """What megatron-core set up (:func:`megatron_startup`)."""

    data_parallel_size: int  # parallel_state.get_data_parallel_world_size()
    transformer_config: Any  # megatron.core TransformerConfig
    ddp_config: Any  # megatron.core DistributedDataParallelConfig
    expert_group: list[int]  # global ranks of rank's expert-model-parallel (EP) group
    expert_data_group: list[int]  # ... of its expert-data-parallel group


def megatron_startup(argv: Sequence[str], world_size: int, rank: int = 0) -> MegatronStartup:
    """Megatron-LM's start-up for the flags ``argv`` on ``world_size`` ranks, as far as
    megatron-core runs it on CPU.

    Runs: the flags read as ``megatron/training/arguments.py`` reads them
    (:func:`framework_configs.megatron_fields_from_flags`, its asserts included);
    ``megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_size,
    pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
    context_parallel_size)``, what Megatron-LM's ``_initialize_distributed`` calls (it
    raises RuntimeError unless tp·pp·cp divides the world size and builds every tp, pp,
    dp, cp, embedding and expert group); megatron-core's micro-batch calculator
    (``init_num_microbatches_calculator`` with the data-parallel size parallel_state
    computed: AssertionError unless ``--global-batch-size`` is a multiple of
    ``--micro-batch-size`` x dp), when both flags are given; ``TransformerConfig`` and the
    decoder layers of each (pipeline rank, virtual stage)
    (:func:`framework_configs.megatron_config`); ``DistributedDataParallelConfig`` with
    ``use_distributed_optimizer`` from ``--use-distributed-optimizer`` and
    ``grad_reduce_in_fp32`` as Megatron-LM sets it (``validate_args``: under ``--bf16``,
    ``accumulate_allreduce_grads_in_fp32`` is True unless ``--grad-reduce-in-bf16``; without
    ``--bf16`` it stays False; ``training.py`` passes it as ``grad_reduce_in_fp32``).

    With MoE flags, ``expert_model_parallel_size`` and ``expert_tensor_parallel_size`` go to
    ``initialize_model_parallel`` as Megatron-LM's ``_initialize_distributed`` passes them,
    and the EP and expert-data-parallel groups of ``rank`` come back (global ranks).

    The process groups use the fake backend: megatron-core creates its groups with
    ``backend=None`` (the default group's, so fake) except its gloo side groups, which gloo
    cannot build on a ``FakeStore`` (RuntimeError "Not implemented" from the store):
    ``create_gloo_process_groups=False`` (Megatron-LM's ``--disable-gloo-process-groups``)
    is the one change. Model parallel state, the
    calculator and the group are destroyed on return.

    Not run (needs a GPU): building ``GPTModel`` (its local layer spec refuses sequence
    parallelism without Transformer Engine; parameters on ``torch.cuda.current_device()``
    unless ``use_cpu_initialization``) and megatron-core's ``DistributedDataParallel``,
    whose gradient buffers are allocated with ``device=torch.cuda.current_device()``.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )

    fields = fc.megatron_fields_from_flags(argv)
    flags, _ = fc._megatron_flag_parser().parse_known_args(list(argv))

    def destroy():
        parallel_state.destroy_model_parallel()
        destroy_num_microbatches_calculator()
        torch.distributed.destroy_process_group()

    with fake_process_group(world_size, rank=rank, destroy=destroy):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=fields["tensor_model_parallel_size"],
            pipeline_model_parallel_size=fields["pipeline_model_parallel_size"],
            virtual_pipeline_model_parallel_size=fields["virtual_pipeline_model_parallel_size"],
            context_parallel_size=fields["context_parallel_size"],
            create_gloo_process_groups=False,
            expert_model_parallel_size=fields.get("expert_model_parallel_size", 1),
            expert_tensor_parallel_size=fields.get("expert_tensor_parallel_size"))
        dp = parallel_state.get_data_parallel_world_size()
        ep_group = torch.distributed.get_process_group_ranks(
            parallel_state.get_expert_model_parallel_group())
        edp_group = torch.distributed.get_process_group_ranks(
            parallel_state.get_expert_data_parallel_group())
        if flags.global_batch_size is not None and flags.micro_batch_size is not None:
            init_num_microbatches_calculator(0, None, flags.global_batch_size,
                                             flags.micro_batch_size, dp,
                                             decrease_batch_size_if_needed=False)
            get_num_microbatches()
        config = fc.megatron_config(fields)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=bool(flags.bf16 and not flags.grad_reduce_in_bf16),
            use_distributed_optimizer=flags.use_distributed_optimizer)
    return MegatronStartup(dp, config, ddp_config, ep_group, edp_group)


# --------------------------------------------------------------------------------------
# DeepSpeed 0.19.8
# --------------------------------------------------------------------------------------

class Block(torch.nn.Module):
    """The tiny transformer-layer stand-in; its class name is the one autopar's DeepSpeed
    config partitions on (``"partition": "type:Block"``)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.proj(x)


@dataclasses.dataclass
class DeepSpeedStartup:
    """What ``deepspeed.initialize`` built (:func:`deepspeed_startup`)."""

    engine: Any  # DeepSpeedEngine or PipelineEngine
    config: Any  # the engine's DeepSpeedConfig
    dp_world_size: int
    zero_stage: int
    optimizer: str  # class name of the engine's (wrapped) optimizer
    communication_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    stage_blocks: list[int] | None  # Block layers per pipeline stage (PipelineModule)
    activation_checkpoint_interval: int | None  # the PipelineModule's, after the engine


def deepspeed_startup(config: dict, world_size: int, pipeline_parallel_size: int,
                      num_layers: int | None = None, hidden: int = 16,
                      partition_method: str = "type:Block") -> DeepSpeedStartup:
    """DeepSpeed 0.19.8's ``deepspeed.initialize`` for ``config`` on rank 0 of
    ``world_size``, on a tiny model: a ``Linear`` in, ``num_layers`` :class:`Block` layers
    (default 2 per stage), a ``Linear`` out, of width ``hidden``.

    With ``pipeline_parallel_size`` > 1 the model is a ``PipelineModule(num_stages=p,
    partition_method=partition_method)`` (``deepspeed/runtime/pipe/module.py``: RuntimeError
    unless p divides the world; its ``PipelineParallelGrid`` builds the pipe and data groups;
    ``_partition_layers`` splits the layers, "type:Block" into equal Block counts), as the
    model code autopar's config describes; otherwise the plain layers. The whole engine
    constructor runs (``deepspeed/__init__.py`` ``initialize``): ``DeepSpeedConfig``
    (``train_batch_size == micro x accumulation x dp``, dp from the pipeline grid),
    ``DeepSpeedEngine.__init__`` (model broadcast, precision, the optimizer choice of
    ``_do_optimizer_sanity_check``, e.g. NotImplementedError for bf16 with fp32 gradient
    accumulation at ZeRO-0, and the ZeRO-1/2/3 optimizer that partitions the model), and
    for a ``PipelineModule`` ``PipelineEngine.__init__`` (``pipe/engine.py``: ZeRO stage < 2,
    ``train_batch_size == micro_batch_size * micro_batches * grid.data_parallel_size``, the
    pipeline's ``activation_checkpoint_interval`` set on the module).

    The optimizer is a client ``torch.optim.AdamW`` handed to ``deepspeed.initialize``
    (autopar's config names none; DeepSpeed's own "Adam" is FusedAdam, a CUDA op), which
    DeepSpeed wraps as the config decides. On CPU DeepSpeed uses its CPU accelerator;
    ``deepspeed.comm`` wraps the fake group (``init_distributed`` after torch's), and is
    torn down with ``deepspeed.comm.destroy_process_group``, which also drops DeepSpeed's
    cached groups. Patched: ``LOCAL_RANK=0`` in the environment during the call; after it,
    ``torch.nn.functional.linear`` is restored (ZeRO-3's engine replaces it process-wide).
    Nothing of the engine's start-up is left out; training steps are not run.
    """
    import deepspeed
    import deepspeed.comm as ds_comm
    from deepspeed.pipe import LayerSpec, PipelineModule

    p = pipeline_parallel_size
    num_layers = num_layers or 2 * p
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the engine seeds and draws
        stack.enter_context(mock.patch.dict(os.environ, {"LOCAL_RANK": "0"}))
        stack.enter_context(fake_process_group(world_size, destroy=ds_comm.destroy_process_group))
        # DeepSpeed prints its topology and partition on rank 0
        stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        specs = ([LayerSpec(torch.nn.Linear, hidden, hidden)]
                 + [LayerSpec(Block, hidden) for _ in range(num_layers)]
                 + [LayerSpec(torch.nn.Linear, hidden, hidden)])
        if p > 1:
            model = PipelineModule(layers=specs, num_stages=p, partition_method=partition_method,
                                   loss_fn=torch.nn.MSELoss())
        else:
            model = torch.nn.Sequential(*(spec.build() for spec in specs))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # ZeRO-3 swaps torch.nn.functional.linear for its own for good ("This will persist
        # unless manually reset", runtime/zero/partition_parameters.py): put it back after
        linear = torch.nn.functional.linear
        stack.callback(setattr, torch.nn.functional, "linear", linear)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=copy.deepcopy(config))
    stage_blocks = interval = None
    if p > 1:
        bounds = [int(b) for b in model.parts]
        stage_blocks = [sum(spec.typename is Block for spec in specs[lo:hi])
                        for lo, hi in itertools.pairwise(bounds)]
        interval = model.activation_checkpoint_interval
    _, accum_dtype = engine.get_data_types()
    return DeepSpeedStartup(
        engine=engine, config=engine._config, dp_world_size=engine.dp_world_size,
        zero_stage=engine.zero_optimization_stage(), optimizer=type(engine.optimizer).__name__,
        communication_dtype=engine.communication_data_type, grad_accum_dtype=accum_dtype,
        stage_blocks=stage_blocks, activation_checkpoint_interval=interval)
