"""Megatron-LM's parallel-layout rules, copied from ``validate_args`` at tag core_v0.16.1.

:func:`validate_layout_args` checks the Megatron-LM flags autopar emits
(``autopar.frameworks.megatron.megatron_args``) against the rules of
``megatron/training/arguments.py::validate_args`` that concern the parallel layout. The
rules come from Megatron-LM tag ``core_v0.16.1``, commit
``55ac7082517c3878ae653c07c09c534b8aed49f6``; arguments.py there is blob 46f3c28b, 2902
lines, with ``validate_args`` at L293-1285. Megatron-LM's ``megatron.training`` is not on
PyPI, so this module carries a copy of those rules. Every rule keeps the tag's statement,
exception type and message text, and sits in validate_args' order. A ``# arguments.py L<n>``
comment sits on each one, and likewise ``# <file> L<n>`` on the few rules taken from other
files. Those few run after validate_args, in the order Megatron-LM's ``initialize_megatron``
runs them.

The flags are declared as the tag declares them: the same option strings, dest, action,
type, nargs, choices and default. Hand-written declarations cite their arguments.py line.
The others are generated from a config dataclass by ``ArgumentGroupFactory``
(``megatron/training/argument_utils.py``), and the comment names that dataclass. A flag not
declared here raises ValueError naming it. So a rule that is not ported always sees its
flags at the tag's defaults, and every rule left out below passes at those defaults.

Ported, in order:

* arguments.py L309-312: the legacy-model checkpoint format, and ``use_dist_ckpt``
  (``training/utils.py`` L762-763).
* arguments.py L314-328: world size divisible by tp·pp·cp, ``--attention-backend local``
  only with ``--spec local`` (L321), ``data_parallel_size``.
* arguments.py L339-388: the ``--perform-rl-step`` rules on expert parallelism, micro/global
  batch and the intervals counted in global batches. As at the tag, they run before the
  global batch's default (L497): without ``--global-batch-size`` they raise TypeError. The
  RL KV-cache and offload asserts in that block (L340-351) are not ported.
* arguments.py L403-411: hierarchical context parallelism, ``expert_tensor_parallel_size``.
* arguments.py L414-432: ``--batch-size`` and ``--model-parallel-size`` refused,
  ``--checkpoint-activations`` exits, ``--recompute-activations`` means selective.
* arguments.py L434-454: the deprecated CUDA-graph switches become ``cuda_graph_impl``
  (L1158 reads it with expert parallelism; L920 reads ``enable_cuda_graph``).
* arguments.py L488-500: phase transitions without ramp-up, micro and global batch.
* arguments.py L502-591: virtual pipeline size from ``--num-layers-per-virtual-pipeline-stage``,
  ``--num-virtual-stages-per-pipeline-rank`` or ``--pipeline-model-parallel-layout``; layers
  divisible by the pipeline size; the interleaved schedule's pipeline size.
* arguments.py L597-623, L635-643: overlapped grad reduce and param gather, Torch-FSDP2,
  param gather with the optimizer step.
* arguments.py L650, L671-695: ``main_grads_dtype``, Megatron-FSDP, manual FSDP registration.
* arguments.py L700-724: fp16/bf16, ``params_dtype`` and ``accumulate_allreduce_grads_in_fp32``
  (fp32 gradient reduction under bf16 unless ``--grad-reduce-in-bf16``). L707-710 are not
  ported: they turn off the NaN check under fp16 with dynamic loss scaling, a non-layout
  value.
* arguments.py L735-736: ``dataloader_type`` (L922 reads it).
* arguments.py L765-766: no batch-size ramp-up with ``--train-iters``.
* arguments.py L786-834: the layer count, required arguments, ``ffn_hidden_size``,
  ``kv_channels``, sequence length divisible by 2·cp, and sequence length within the
  position embeddings.
* arguments.py L884-962: distributed saved activations, selective recompute, sequence
  parallelism dropped at tp = 1, TP communication overlap, hybrid context parallelism,
  ``CUDA_DEVICE_MAX_CONNECTIONS`` with tp or cp > 1 before Blackwell, and FSDP's
  high-priority stream groups.
* arguments.py L1009-1011: ``--position-embedding-type mrope`` needs ``--mrope-section``.
  This is a model rule, ported because autopar emits ``--position-embedding-type``.
* arguments.py L1014-1028: MoE ``num_experts``/``moe_ffn_hidden_size``, context parallelism
  on legacy models, expert parallelism dividing the experts.
* arguments.py L1041-1050, L1095-1104: checkpoint formats under FSDP/tp/pp, and the
  distributed optimizer without Gloo.
* arguments.py L1147-1152, L1158-1160: pipeline-parallel microbatched inference, and CUDA
  graphs with expert parallelism.
* arguments.py L1178-1187, L1240-1253, L1265-1266: Muon without distributed optimizer, FSDP
  or overlap; the CUDA-graph environment rule (it reads ``--cuda-graph-impl``); multi-latent
  vs grouped-query attention.
* Outside validate_args, run next by ``initialize_megatron``:

  * ``training/global_vars.py`` L93-100 builds megatron-core's constant micro-batch
    calculator (``core/num_microbatches_calculator.py`` L219-226, L261-263, L315-350). Its
    rules: the global batch divisible by micro batch × dp, and at least one micro-batch.
    This adds ``num_microbatches`` to the namespace; the tag's args have no such attribute.
  * ``training/initialize.py`` L364-385 calls ``core/parallel_state.py``
    ``initialize_model_parallel``. Ported from it: the world size divisible by etp·ep·pp
    (L786-795); the same data-parallel size for attention and experts unless pp is last
    (L808-812); the same pipeline groups for both (L814-817, with megatron-core's own
    ``RankGenerator``); dp·cp divisible by ``--num-distributed-optimizer-instances``
    (L833-837); an even dp·cp group under hybrid context parallelism (L938-943).

Derived values the namespace carries, as validate_args sets them:

* ``data_parallel_size``, ``transformer_pipeline_model_parallel_size``,
  ``virtual_pipeline_model_parallel_size`` (None for 1), ``expert_tensor_parallel_size``;
* ``global_batch_size`` (default mbs·dp), ``recompute_granularity``,
  ``overlap_p2p_comm``/``align_param_gather`` (False without VP);
* ``params_dtype``, ``main_grads_dtype`` (a torch dtype), ``accumulate_allreduce_grads_in_fp32``;
* ``sequence_parallel`` (False at tp = 1), ``use_dist_ckpt``, ``use_custom_fsdp``;
* ``dataloader_type``, ``num_layers``/``encoder_num_layers``, ``ffn_hidden_size``,
  ``kv_channels``, ``seq_length``/``encoder_seq_length``, ``num_experts``/``moe_ffn_hidden_size``,
  ``high_priority_stream_groups``, ``cuda_graph_impl``;
* ``rank`` and ``world_size`` as ``parse_args`` sets them (L113-114): rank from ``RANK`` in
  ``environ``, the world size from the argument.

Not ported. Each rule below fails only through a flag that is not declared here, or only
after a ported rule has already failed. An undeclared flag is refused, so it stays at the
tag's default, and the rule passes there. Derived values outside the layout are not set
either: bias and RoPE fusion (L965-995), ``te_rng_tracker`` (L1241-1245),
``reuse_grad_buf_for_mxfp8_param_ag`` (L697-698), the consumed-sample counters (L742-753).

* L625-633, L655-657 (``--fp8-param-gather`` needs distributed optimizer or FSDP; dropped
  under FSDP2 with TE >= 2.0), L659-669 (FP4), L1190-1198 (optimizer CPU offload): FP8/FP4
  training and optimizer offload are outside autopar's plans; its Megatron reader refuses
  every ``--fp8-*`` flag. L625 and L668 also depend on the Transformer Engine version
  installed on the GPUs.
* L1209-1219 (delayed wgrad with overlapped grad reduce or without gradient-accumulation
  fusion): these depend on the Transformer Engine version, and autopar emits no delayed
  wgrad.
* The RL KV-cache asserts (L331-351), data paths (L468-486), sample- and iteration-based
  schedules other than L765 (L756-784), learning rate, save and log intervals (L835-844),
  fp16 cross entropy / fp32 residual (L846-850), grouped GEMM capability (L852-854), weight
  decay (L856-874), qk-clip, RoPE and position-embedding rules other than mrope
  (L972-1007), MoE router lists (L1031-1034), legacy dist-ckpt (L1037-1038), data blends,
  FIM and deterministic mode (L1053-1082), the fake process group (L1106-1112), checkpoint
  loading and saving (L1116-1144, L1200-1207), dynamic-batching inference (L1154-1156),
  upcycling and --skip-train (L1163-1175), activation offloading, MTP and CPU offloading
  (L1222-1237), CUDA-graph scopes (L725-731, L1255-1261), MoE latent size (L1269-1273),
  tokenizer (L1275-1280), attention backend (L321-322), heterogeneous configs (L306),
  --warmup (L417-419). None of these concerns the parallel layout.
* ``ModelParallelConfig``/``TransformerConfig.__post_init__`` (heads and query groups vs
  tp, uneven first/last stages, layout contents, recompute method and layer count,
  MoE/ETP, ...), ``PipelineParallelLayerLayout.validate_layer_layout`` and
  ``get_num_layers_to_build``: megatron-core runs these when it builds the config and the
  model. The installed megatron-core 0.16.1 holds those files byte-identical to the tag,
  and ``tests/framework_configs.py::megatron_config`` runs them there, rather than a copy.
  Validate_args only parses the layout into its stage count (L519, with megatron-core's own
  ``PipelineParallelLayerLayout.get_num_stages_from_str``). It leaves the uneven
  first/last stages unchecked.
* ``core/parallel_state.py`` L740-741 and L745-749 repeat arguments.py L317 and L575/L579,
  and can no longer fail after them. The ramp-up micro-batch calculator
  (``num_microbatches_calculator.py`` L232-256, L387-...) runs only with
  ``--rampup-batch-size``, which autopar never emits. Its global batch changes during
  training and is checked at every step, so it is not simple.

Environment: validate_args reads ``CUDA_DEVICE_MAX_CONNECTIONS`` (L622, L687, L951), and
``PYTORCH_CUDA_ALLOC_CONF``/``NCCL_GRAPH_REGISTER`` (L1248-1253) from ``os.environ``, and
calls ``get_device_arch_version()`` (``training/utils.py`` L446-448: the major compute
capability of cuda:0; 8 Ampere, 9 Hopper, 10 Blackwell). Here these are the ``environ`` and
``device_arch`` arguments: ``os.environ`` and 9 by default. ``is_torch_min_version`` and
``get_torch_version`` are megatron-core's, applied to the torch installed here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

import torch

TAG = "core_v0.16.1"
COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"


def layout_flag_parser() -> argparse.ArgumentParser:
    """The flags :func:`validate_layout_args` reads, declared as Megatron-LM's tag declares them.

    "arguments.py L<n>": declared by hand there. "<Config>": generated from that dataclass's
    field of the same name (``ArgumentGroupFactory``, argument_utils.py: Optional[X] -> X,
    list -> nargs "+", Literal -> choices, a bool -> store_true, or store_false when it
    defaults to True), with the default the dataclass (or its ``argparse_meta``) gives.
    """
    p = argparse.ArgumentParser(prog="megatron-layout", add_help=False, allow_abbrev=False,
                                exit_on_error=False)

    def store_true(flag, **kw):
        p.add_argument(flag, action="store_true", **kw)

    # --- model shape (TransformerConfig unless a line is given)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--encoder-num-layers", type=int, default=None)  # L1626
    p.add_argument("--decoder-num-layers", type=int, default=None)  # L1628
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--num-attention-heads", type=int, default=None)
    p.add_argument("--kv-channels", type=int, default=None)
    store_true("--group-query-attention")  # L1630
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--max-position-embeddings", type=int, default=None)  # L1642
    p.add_argument("--position-embedding-type", type=str, default="learned_absolute",  # L1645
                   choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    p.add_argument("--mrope-section", type=int, nargs="+", default=None)
    p.add_argument("--rotary-base", type=int, default=10000)  # L1655
    p.add_argument("--normalization", type=str, default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    store_true("--swiglu")  # L1687
    p.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    store_true("--untie-embeddings-and-output-weights")  # L1697
    p.add_argument("--hidden-dropout", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    store_true("--multi-latent-attention")
    p.add_argument("--vocab-size", type=int, default=None)  # L2373
    p.add_argument("--seq-length", type=int, default=None)  # L2482
    p.add_argument("--encoder-seq-length", type=int, default=None)  # L2484
    p.add_argument("--decoder-seq-length", type=int, default=None)  # L2487
    # MoE
    p.add_argument("--num-experts", type=int, default=None)  # L2691
    p.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    p.add_argument("--moe-layer-freq", type=str, default=1)  # L2693 (moe_freq_type: not read here)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                   choices=["allgather", "alltoall", "flex"])
    store_true("--moe-grouped-gemm")
    store_true("--moe-router-pre-softmax")
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    store_true("--moe-shared-expert-gate")
    store_true("--moe-use-legacy-grouped-gemm")
    store_true("--moe-pad-experts-for-cuda-graph-inference")  # L2717

    # --- parallel sizes (ModelParallelConfig unless a line is given)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None)
    p.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])  # L2341
    store_true("--hybrid-context-parallel")
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    store_true("--sequence-parallel")
    store_true("--tp-comm-overlap")
    store_true("--overlap-moe-expert-parallel-comm")
    p.add_argument("--model-parallel-size", type=int, default=None)  # L2225
    store_true("--use-tp-pp-dp-mapping", default=False)  # L2352
    # pipeline split (arguments.py unless TransformerConfig is named)
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)  # L2209
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)  # L2213
    p.add_argument("--pipeline-model-parallel-layout", type=str, default=None)  # L2217
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)  # L2228
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)  # L2230
    p.add_argument("--no-overlap-p2p-communication", action="store_false",  # L2232
                   dest="overlap_p2p_comm")
    store_true("--account-for-embedding-in-pipeline-split")  # TransformerConfig
    store_true("--account-for-loss-in-pipeline-split")  # TransformerConfig

    # --- batch (TrainingConfig unless a line is given)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)  # L2006
    p.add_argument("--rampup-batch-size", type=int, nargs=3, default=None)
    store_true("--decrease-batch-size-if-needed")
    p.add_argument("--phase-transition-iterations", type=str, default=None)  # L2439
    p.add_argument("--train-iters", type=int, default=None)
    p.add_argument("--exit-interval", type=int, default=None)
    p.add_argument("--dataloader-type", type=str, default=None,  # L2075
                   choices=["single", "cyclic", "external"])
    store_true("--calculate-per-token-loss")  # TransformerConfig
    # RL (arguments.py)
    store_true("--perform-rl-step")  # L1870
    p.add_argument("--grpo-prompts-per-step", type=int, default=32)  # L1877
    p.add_argument("--grpo-group-size", type=int, default=2)  # L1879
    p.add_argument("--grpo-iterations", type=int, default=2)  # L1881
    p.add_argument("--rl-use-sequence-packing", action=argparse.BooleanOptionalAction,  # L1923
                   type=bool, default=False)
    p.add_argument("--rl-inference-expert-model-parallel-size", type=int, default=None)  # L1944

    # --- recompute (TransformerConfig unless a line is given)
    p.add_argument("--recompute-granularity", type=str, default=None, choices=("full", "selective"))
    p.add_argument("--recompute-method", type=str, default=None, choices=("uniform", "block"))
    p.add_argument("--recompute-num-layers", type=int, default=None)
    store_true("--distribute-saved-activations")
    store_true("--recompute-activations")  # L2009
    store_true("--checkpoint-activations")  # L2027
    # CUDA graphs (TransformerConfig)
    store_true("--enable-cuda-graph")
    store_true("--external-cuda-graph")
    p.add_argument("--cuda-graph-impl", type=str, default="none",
                   choices=("none", "local", "transformer_engine"))
    p.add_argument("--inference-batch-times-seqlen-threshold", type=int, default=-1)  # L1411

    # --- data parallelism, optimizer, checkpoints (arguments.py unless a dataclass is named)
    store_true("--use-distributed-optimizer")  # L2283
    p.add_argument("--num-distributed-optimizer-instances", type=int, default=1)  # L2333
    store_true("--overlap-grad-reduce", default=False)  # L2243
    store_true("--overlap-param-gather", default=False)  # L2264
    store_true("--overlap-param-gather-with-optimizer-step", default=False)  # L2266
    p.add_argument("--no-align-param-gather", action="store_false",  # L2268
                   dest="align_param_gather")
    store_true("--use-megatron-fsdp")  # L2305
    p.add_argument("--data-parallel-sharding-strategy", type=str, default="no_shard",  # L2307
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    store_true("--use-torch-fsdp2")  # L2335
    store_true("--fsdp-manual-registration", dest="fsdp_manual_registration",  # L2292
               default=False)
    store_true("--use-nccl-ub", dest="nccl_ub")  # L2285
    p.add_argument("--no-gradient-accumulation-fusion", action="store_false",  # L2083
                   dest="gradient_accumulation_fusion")
    p.add_argument("--disable-gloo-process-groups", action="store_false",  # L2020
                   dest="enable_gloo_process_groups")
    p.add_argument("--high-priority-stream-groups", nargs="*", type=str, default=[])  # L2095
    p.add_argument("--optimizer", type=str, default="adam",  # L2056
                   choices=["adam", "sgd", "muon", "dist_muon"])
    store_true("--use-legacy-models")  # L2093
    p.add_argument("--ckpt-format", type=str, default="torch_dist",  # CheckpointConfig
                   choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"))
    store_true("--dist-ckpt-optim-fully-reshardable")  # CheckpointConfig
    store_true("--distrib-optim-fully-reshardable-mem-efficient")  # CheckpointConfig
    p.add_argument("--save-interval", "--persistent-save-interval", type=int,  # CheckpointConfig
                   default=None)
    p.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int,  # TrainingConfig
                   default=None)

    # --- precision (ModelParallelConfig for --fp16/--bf16; arguments.py otherwise)
    store_true("--fp16")
    store_true("--bf16")
    store_true("--grad-reduce-in-bf16")  # L2178
    store_true("--accumulate-allreduce-grads-in-fp32")  # L2194
    p.add_argument("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"])  # L2844

    # --- attention kernel
    from megatron.core.transformer.enums import AttnBackend  # argument_utils.py L85-94: an Enum

    p.add_argument("--attention-backend", type=lambda name: AttnBackend[name],  # TransformerConfig
                   choices=list(AttnBackend), default=AttnBackend.auto)
    p.add_argument("--spec", type=str, default=None, nargs="*")  # L2815
    return p


def validate_layout_args(argv: Sequence[str], world_size: int, *,
                         environ: Mapping[str, str] | None = None,
                         device_arch: int = 9) -> argparse.Namespace:
    """Megatron-LM's parsed and validated args for the flags ``argv`` on ``world_size`` ranks,
    with the parallel-layout rules of validate_args at tag core_v0.16.1 applied (module
    docstring), or the tag's exception and message for the first rule the flags break.

    ``environ`` stands for the launch's environment (``os.environ`` when None) and
    ``device_arch`` for ``get_device_arch_version()`` on its GPUs. A flag not declared by
    :func:`layout_flag_parser` raises ValueError; a bad value for a declared flag raises
    ``argparse.ArgumentError``.
    """
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.utils import get_torch_version, is_torch_min_version

    env = os.environ if environ is None else environ
    args, unknown = layout_flag_parser().parse_known_args(list(argv))
    if unknown:
        raise ValueError(f"flags validate_layout_args does not know: {unknown}")
    args.rank = int(env.get("RANK", "0"))  # arguments.py L113 (parse_args)
    args.world_size = world_size  # arguments.py L114: WORLD_SIZE

    # Set args.use_dist_ckpt from args.ckpt_format.
    if args.use_legacy_models:  # arguments.py L309
        assert args.ckpt_format == "torch", \
            "legacy model format only supports the 'torch' checkpoint format."  # arguments.py L310
    args.use_dist_ckpt = args.ckpt_format != "torch"  # arguments.py L312 -> training/utils.py L763

    total_model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size  # arguments.py L314

    # Total model size.
    assert args.world_size % total_model_size == 0, (  # arguments.py L317
        f"world size ({args.world_size}) is not divisible by total_model_size ({total_model_size=})"
    )

    if args.attention_backend == AttnBackend.local:  # arguments.py L321
        assert args.spec[0] == 'local' , '--attention-backend local is only supported with --spec local'  # arguments.py L322

    # Pipeline model parallel size.
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size  # arguments.py L325

    total_model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size  # arguments.py L327
    args.data_parallel_size = args.world_size // total_model_size  # arguments.py L328

    # Batch size checks if running RL.
    if args.perform_rl_step:  # arguments.py L339
        # When using different EP sizes for inference and training (EP refit), the legacy
        # GroupedMLP is not supported. Only SequentialMLP or TEGroupedMLP can be used.
        if (  # arguments.py L356
            args.rl_inference_expert_model_parallel_size is not None
            and args.rl_inference_expert_model_parallel_size != args.expert_model_parallel_size
        ):
            assert not args.moe_use_legacy_grouped_gemm, (  # arguments.py L360
                "Legacy GroupedMLP (--moe-use-legacy-grouped-gemm) is not supported when using "
                "different expert parallelism sizes for inference and training. "
                "Use SequentialMLP (default when --moe-grouped-gemm is not set) or "
                "TEGroupedMLP (--moe-grouped-gemm without --moe-use-legacy-grouped-gemm)."
            )

        args.grpo_samples_per_iteration = args.grpo_prompts_per_step * args.grpo_group_size  # arguments.py L367
        num_generated_samples_per_inference_iteration = (  # arguments.py L368
            args.grpo_samples_per_iteration * args.grpo_iterations)

        # Ensure that the number of prompts we collect is a multiple of the global batch size.
        assert num_generated_samples_per_inference_iteration % args.global_batch_size == 0, \
            "grpo_group_size * grpo_prompts_per_step * grpo_iterations should be divisible by global_batch_size"  # arguments.py L373

        num_training_iterations_per_inference_iteration = (  # arguments.py L378
            num_generated_samples_per_inference_iteration // args.global_batch_size)
        if args.exit_interval is not None:  # arguments.py L380
            assert args.exit_interval % num_training_iterations_per_inference_iteration == 0, \
                "exit_interval should be divisible by number of global batches per inference iteration."  # arguments.py L381
        if args.save_interval is not None:  # arguments.py L383
            assert args.save_interval % num_training_iterations_per_inference_iteration == 0, \
                "save_interval should be divisible by number of global batches per inference iteration."  # arguments.py L384
        if args.rl_use_sequence_packing:  # arguments.py L386
            assert args.micro_batch_size == 1, \
                "micro_batch_size must be 1 when using sequence packing. To increase compute per micro batch increase the sequence length."  # arguments.py L387

    # Checks.
    if args.hierarchical_context_parallel_sizes:  # arguments.py L403
        from numpy import prod
        assert args.context_parallel_size == prod(args.hierarchical_context_parallel_sizes)  # arguments.py L405
    if "a2a+p2p" in args.cp_comm_type:  # arguments.py L406
        assert args.hierarchical_context_parallel_sizes is not None, \
        "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm"  # arguments.py L407

    if args.expert_tensor_parallel_size is None:  # arguments.py L410
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size  # arguments.py L411

    # Deprecated arguments.
    assert args.batch_size is None, '--batch-size argument is no longer ' \
        'valid, use --micro-batch-size instead'  # arguments.py L414
    del args.batch_size  # arguments.py L416
    assert args.model_parallel_size is None, '--model-parallel-size is no ' \
        'longer valid, use --tensor-model-parallel-size instead'  # arguments.py L420
    del args.model_parallel_size  # arguments.py L422

    if args.checkpoint_activations:  # arguments.py L424
        print('--checkpoint-activations is no longer valid, use --recompute-activations, '
              'or, for more control, --recompute-granularity and --recompute-method.')  # arguments.py L425 (print_rank_0)
        raise SystemExit(None)  # arguments.py L427: exit()
    del args.checkpoint_activations  # arguments.py L428

    if args.recompute_activations:  # arguments.py L430
        args.recompute_granularity = 'selective'  # arguments.py L431
    del args.recompute_activations  # arguments.py L432

    if args.enable_cuda_graph or args.external_cuda_graph:  # arguments.py L434
        assert (
            args.cuda_graph_impl == "none"
        ), "Do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl."  # arguments.py L435
        assert (
            not args.enable_cuda_graph or not args.external_cuda_graph
        ), "--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time."  # arguments.py L438

        if args.enable_cuda_graph:  # arguments.py L442
            args.cuda_graph_impl = "local"  # arguments.py L446
            del args.enable_cuda_graph  # arguments.py L447
        if args.external_cuda_graph:  # arguments.py L448
            args.cuda_graph_impl = "transformer_engine"  # arguments.py L453
            del args.external_cuda_graph  # arguments.py L454

    if args.phase_transition_iterations:  # arguments.py L488
        args.phase_transition_iterations = sorted(
            int(x.strip()) for x in args.phase_transition_iterations.split(",")
        )  # arguments.py L489
        assert args.rampup_batch_size is None, "multi-phase training does not support batch size ramp-up"  # arguments.py L492

    # Batch size.
    assert args.micro_batch_size is not None  # arguments.py L495
    assert args.micro_batch_size > 0  # arguments.py L496
    if args.global_batch_size is None:  # arguments.py L497
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size  # arguments.py L498
    assert args.global_batch_size > 0  # arguments.py L500

    # Uneven virtual pipeline parallelism
    assert (  # arguments.py L503
        int(args.num_layers_per_virtual_pipeline_stage is not None)
        + int(args.num_virtual_stages_per_pipeline_rank is not None)
        + int(args.pipeline_model_parallel_layout is not None)
    ) <= 1, (
        'No more than one of the following arguments can be set at the same time: '
        '--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank,'
        '--pipeline-model-parallel-layout. '
        f'{args.num_layers_per_virtual_pipeline_stage=}, '
        f'{args.num_virtual_stages_per_pipeline_rank=}, '
        f'{args.pipeline_model_parallel_layout=}.'
    )

    if args.pipeline_model_parallel_layout is not None:  # arguments.py L516
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )

        # Parse the input flattened layout to a list and get the vpp size.
        # We will validate the layout more carefully in the TransformerConfig constructor.
        num_stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)  # arguments.py L519
        assert num_stages % args.pipeline_model_parallel_size == 0, (  # arguments.py L520
            f"The length of pipeline_model_parallel_layout must be divisible"
            f" by pipeline_model_parallel_size ({num_stages=},"
            f" {args.pipeline_model_parallel_size=})"
        )
        args.virtual_pipeline_model_parallel_size = num_stages // args.pipeline_model_parallel_size  # arguments.py L525
        if args.virtual_pipeline_model_parallel_size == 1:  # arguments.py L526
            args.virtual_pipeline_model_parallel_size = None  # arguments.py L527
    elif args.num_layers_per_virtual_pipeline_stage is not None or args.num_virtual_stages_per_pipeline_rank is not None:  # arguments.py L528
        if args.num_virtual_stages_per_pipeline_rank is None:  # arguments.py L529
            assert args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None, \
                'please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel degree when enable uneven pipeline parallelism'  # arguments.py L530
            if args.num_layers is not None:  # arguments.py L532
                num_layers = args.num_layers
            else:
                num_layers = args.decoder_num_layers  # arguments.py L535

            if args.account_for_embedding_in_pipeline_split:  # arguments.py L537
                num_layers += 1

            if args.account_for_loss_in_pipeline_split:  # arguments.py L540
                num_layers += 1

            assert num_layers % args.transformer_pipeline_model_parallel_size == 0, \
                'number of layers of the model must be divisible pipeline model parallel size'  # arguments.py L543
            num_layers_per_pipeline_stage = num_layers // args.transformer_pipeline_model_parallel_size  # arguments.py L545

            assert num_layers_per_pipeline_stage % args.num_layers_per_virtual_pipeline_stage == 0, \
                'number of layers per pipeline stage must be divisible number of layers per virtual pipeline stage'  # arguments.py L547
            args.virtual_pipeline_model_parallel_size = num_layers_per_pipeline_stage // \
                args.num_layers_per_virtual_pipeline_stage  # arguments.py L549
        else:
            args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank  # arguments.py L552
        if args.virtual_pipeline_model_parallel_size == 1:  # arguments.py L553
            args.virtual_pipeline_model_parallel_size = None  # arguments.py L554
    else:
        args.virtual_pipeline_model_parallel_size = None  # arguments.py L556

        if args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None:  # arguments.py L558
            # Divisibility check not applicable for T5 models which specify encoder_num_layers
            # and decoder_num_layers.
            if args.num_layers is not None:  # arguments.py L561
                num_layers = args.num_layers

                if args.account_for_embedding_in_pipeline_split:  # arguments.py L564
                    num_layers += 1

                if args.account_for_loss_in_pipeline_split:  # arguments.py L567
                    num_layers += 1

                assert num_layers % args.transformer_pipeline_model_parallel_size == 0, \
                    'Number of layers should be divisible by the pipeline-model-parallel size'  # arguments.py L570

    if args.virtual_pipeline_model_parallel_size is not None:  # arguments.py L573
        if args.overlap_p2p_comm:  # arguments.py L574
            assert args.pipeline_model_parallel_size > 1, \
                'When interleaved schedule is used, pipeline-model-parallel size '\
                'should be greater than 1'  # arguments.py L575
        else:
            assert args.pipeline_model_parallel_size > 2, \
                'When interleaved schedule is used and p2p communication overlap is disabled, '\
                'pipeline-model-parallel size should be greater than 2 to avoid having multiple '\
                'p2p sends and recvs between same 2 ranks per communication batch'  # arguments.py L579
    else:
        # Overlap P2P communication is disabled if not using the interleaved schedule.
        args.overlap_p2p_comm = False  # arguments.py L585
        args.align_param_gather = False  # arguments.py L586

    if args.overlap_param_gather:  # arguments.py L597
        assert args.use_distributed_optimizer or args.use_megatron_fsdp, \
            '--overlap-param-gather only supported with distributed optimizer or megatron fsdp'  # arguments.py L598
        assert args.overlap_grad_reduce, \
            'Must use --overlap-param-gather with --overlap-grad-reduce'  # arguments.py L600
        assert not args.use_legacy_models, \
            '--overlap-param-gather only supported with MCore models'  # arguments.py L602

    if args.use_torch_fsdp2:  # arguments.py L605
        assert is_torch_min_version("2.4.0"), \
            'FSDP2 requires PyTorch >= 2.4.0 with FSDP 2 support.'  # arguments.py L606
        assert args.pipeline_model_parallel_size == 1, \
            '--use-torch-fsdp2 is not supported with pipeline parallelism'  # arguments.py L608
        assert args.expert_model_parallel_size == 1, \
            '--use-torch-fsdp2 is not supported with expert parallelism'  # arguments.py L610
        assert not args.use_distributed_optimizer, \
            "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"  # arguments.py L612
        assert not args.gradient_accumulation_fusion, \
            '--use-torch-fsdp2 is not supported with gradient accumulation fusion'  # arguments.py L614
        assert args.ckpt_format in ('torch_dist', 'torch_dcp'), \
            '--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp'  # arguments.py L616
        assert args.untie_embeddings_and_output_weights, \
            '--use-torch-fsdp2 requires --untie-embeddings-and-output-weights'  # arguments.py L618
        assert not args.fp16, \
            '--use-torch-fsdp2 not supported with fp16 yet'  # arguments.py L620
        assert env.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1", \
            'FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one'  # arguments.py L622

    if args.overlap_param_gather_with_optimizer_step:  # arguments.py L635
        assert args.use_distributed_optimizer, \
            '--overlap-param-gather-with-optimizer-step only supported with distributed optimizer'  # arguments.py L636
        assert args.overlap_param_gather, \
            'Must use --overlap-param-gather-with-optimizer-step with --overlap-param-gather'  # arguments.py L638
        assert args.virtual_pipeline_model_parallel_size is not None, \
            '--overlap-param-gather-with-optimizer-step only supported with interleaved pipeline parallelism'  # arguments.py L640
        assert not args.use_dist_ckpt, \
            '--overlap-param-gather-with-optimizer-step not supported with distributed checkpointing yet'  # arguments.py L642

    dtype_map = {  # arguments.py L645
        'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp8': torch.uint8,
    }
    map_dtype = lambda d: d if isinstance(d, torch.dtype) else dtype_map[d]  # arguments.py L648
    args.main_grads_dtype = map_dtype(args.main_grads_dtype)  # arguments.py L650

    if args.use_megatron_fsdp:  # arguments.py L671
        args.use_custom_fsdp = True  # arguments.py L675

        if args.data_parallel_sharding_strategy == "optim_grads_params":  # arguments.py L683
            assert args.check_weight_hash_across_dp_replicas_interval is None, \
                'check_weight_hash_across_dp_replicas_interval is not supported with optim_grads_params'  # arguments.py L684

        assert env.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1", \
            'FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one'  # arguments.py L687

        assert args.ckpt_format == "fsdp_dtensor", \
            "Megatron FSDP only supports fsdp_dtensor checkpoint format"  # arguments.py L690

    if args.fsdp_manual_registration:  # arguments.py L693
        assert args.use_megatron_fsdp, "FSDP manual registration is only supported with Megatron FSDP"  # arguments.py L694
        assert args.nccl_ub, "FSDP manual registration is only supported with nccl-ub option"  # arguments.py L695

    # Parameters dtype.
    args.params_dtype = torch.float  # arguments.py L701
    if args.fp16:  # arguments.py L702
        assert not args.bf16  # arguments.py L703
        args.params_dtype = torch.half  # arguments.py L704
    if args.bf16:  # arguments.py L711
        assert not args.fp16  # arguments.py L712
        args.params_dtype = torch.bfloat16  # arguments.py L713
        # bfloat16 requires gradient accumulation and all-reduce to
        # be done in fp32.
        if args.accumulate_allreduce_grads_in_fp32:  # arguments.py L716
            assert args.main_grads_dtype == torch.float32, \
                "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set"  # arguments.py L717

        if args.grad_reduce_in_bf16:  # arguments.py L720
            args.accumulate_allreduce_grads_in_fp32 = False  # arguments.py L721
        elif not args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype == torch.float32:  # arguments.py L722
            args.accumulate_allreduce_grads_in_fp32 = True  # arguments.py L723

    if args.dataloader_type is None:  # arguments.py L735
        args.dataloader_type = 'single'  # arguments.py L736

    # Iteration-based training.
    if args.train_iters:  # arguments.py L756
        assert args.rampup_batch_size is None, \
            'expected no batch-size rampup for iteration-based training'  # arguments.py L765

    if args.num_layers is not None:  # arguments.py L786
        assert args.encoder_num_layers is None, \
            'cannot have both num-layers and encoder-num-layers specified'  # arguments.py L787
        args.encoder_num_layers = args.num_layers  # arguments.py L789
    else:
        assert args.encoder_num_layers is not None, \
            'either num-layers or encoder-num-layers should be specified'  # arguments.py L791
        args.num_layers = args.encoder_num_layers  # arguments.py L793

    # Check required arguments.
    required_args = ['num_layers', 'hidden_size', 'num_attention_heads',
                     'max_position_embeddings']  # arguments.py L796
    for req_arg in required_args:
        assert getattr(args, req_arg) is not None, '{} argument is None'.format(req_arg)  # arguments.py L799 -> L1303

    # Checks.
    if args.ffn_hidden_size is None:  # arguments.py L802
        if args.swiglu:  # arguments.py L803
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64  # arguments.py L809
        else:
            args.ffn_hidden_size = 4 * args.hidden_size  # arguments.py L811

    if args.kv_channels is None:  # arguments.py L813
        assert args.hidden_size % args.num_attention_heads == 0  # arguments.py L814
        args.kv_channels = args.hidden_size // args.num_attention_heads  # arguments.py L815

    if args.seq_length is not None and args.context_parallel_size > 1:  # arguments.py L817
        assert args.seq_length % (args.context_parallel_size * 2) == 0, \
            'seq-length should be a multiple of 2 * context-parallel-size ' \
            'if context-parallel-size > 1.'  # arguments.py L818

    if args.seq_length is not None:  # arguments.py L822
        assert args.encoder_seq_length is None  # arguments.py L823
        args.encoder_seq_length = args.seq_length  # arguments.py L824
    else:
        assert args.encoder_seq_length is not None  # arguments.py L826
        args.seq_length = args.encoder_seq_length  # arguments.py L827

    if args.seq_length is not None:  # arguments.py L829
        assert args.max_position_embeddings >= args.seq_length, \
            f"max_position_embeddings ({args.max_position_embeddings}) must be greater than " \
            f"or equal to seq_length ({args.seq_length})."  # arguments.py L830
    if args.decoder_seq_length is not None:  # arguments.py L833
        assert args.max_position_embeddings >= args.decoder_seq_length  # arguments.py L834

    # Activation recomputing.
    if args.distribute_saved_activations:  # arguments.py L884
        assert args.tensor_model_parallel_size > 1, 'can distribute ' \
            'recomputed activations only across tensor model ' \
            'parallel groups'  # arguments.py L885
        assert args.recompute_granularity == 'full', \
            'distributed recompute activations is only '\
            'application to full recompute granularity'  # arguments.py L888
        assert args.recompute_method is not None, \
            'for distributed recompute activations to work you '\
            'need to use a recompute method '  # arguments.py L891
        assert is_torch_min_version("1.10.0a0"), \
            'distributed recompute activations are supported for pytorch ' \
            'v1.10 and above (Nvidia Pytorch container >= 21.07). Current ' \
            f'pytorch version is v{get_torch_version()}.'  # arguments.py L894

    if args.recompute_granularity == 'selective':  # arguments.py L899
        assert args.recompute_method is None, \
            'recompute method is not yet supported for ' \
            'selective recomputing granularity'  # arguments.py L900

    # disable sequence parallelism when tp=1
    # to avoid change in numerics when
    # sequence_parallelism is enabled.
    if args.tensor_model_parallel_size == 1:  # arguments.py L907
        args.sequence_parallel = False  # arguments.py L913

    if args.tp_comm_overlap:  # arguments.py L915
        assert args.sequence_parallel == True, 'Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is enabled'  # arguments.py L916

    if args.hybrid_context_parallel:  # arguments.py L918
        assert not args.pipeline_model_parallel_size > 1, 'Hybrid context parallelism not supported with pipeline parallelism'  # arguments.py L919
        assert not args.enable_cuda_graph, 'Hybrid context parallelism not supported with CUDA Graph'  # arguments.py L920
        assert not args.use_megatron_fsdp, 'Hybrid context parallelism not supported with Megatron FSDP'  # arguments.py L921
        assert args.dataloader_type == 'single', 'Hybrid context parallelism only supported with single dataloader type'  # arguments.py L922
        assert args.calculate_per_token_loss, 'Hybrid context parallelism must be used with --calculate-per-token-loss'  # arguments.py L923

    # disable async_tensor_model_parallel_allreduce when
    # model parallel memory optimization is enabled
    if (args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1) \
        and device_arch < 10:  # arguments.py L927: get_device_arch_version() < 10
        # CUDA_DEVICE_MAX_CONNECTIONS requirement no longer exists since the Blackwell architecture
        if args.use_torch_fsdp2 or args.use_megatron_fsdp:  # arguments.py L930: a warning
            pass
        elif args.overlap_moe_expert_parallel_comm:  # arguments.py L940: a warning
            pass
        else:
            assert env.get('CUDA_DEVICE_MAX_CONNECTIONS') == "1", \
                "Using tensor model parallelism or context parallelism require setting the environment variable " \
                "CUDA_DEVICE_MAX_CONNECTIONS to 1"  # arguments.py L951

    # Setting FSDP communication groups for high priority streams for Blackwell and later architectures
    if args.use_torch_fsdp2 or args.use_megatron_fsdp and device_arch >= 10:  # arguments.py L958
        if 'dp_cp' not in args.high_priority_stream_groups:  # arguments.py L959
            args.high_priority_stream_groups.append('dp_cp')  # arguments.py L960
        if args.expert_model_parallel_size  > 1 and 'ep_dp' not in args.high_priority_stream_groups:  # arguments.py L961
            args.high_priority_stream_groups.append('ep_dp')  # arguments.py L962

    # MultiModal rotary embeddings arguments
    if args.position_embedding_type == "mrope":  # arguments.py L1009
        assert args.mrope_section is not None, \
            '--mrope-section should be set when using --position-embedding-type mrope.'  # arguments.py L1010

    # MoE Spec check
    if args.num_experts == 0:  # arguments.py L1014
        args.num_experts = None  # arguments.py L1015
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:  # arguments.py L1016
        args.moe_ffn_hidden_size = args.ffn_hidden_size  # arguments.py L1017

    # Context parallel
    if args.context_parallel_size > 1:  # arguments.py L1021
        assert not args.use_legacy_models, "Context parallelism is not supported in legacy models."  # arguments.py L1022

    # Expert parallelism check
    if args.expert_model_parallel_size  > 1:  # arguments.py L1025
        assert args.num_experts is not None, "num_experts must be non None to use expert model parallelism"  # arguments.py L1026
        assert args.num_experts % args.expert_model_parallel_size == 0, \
            "Number of experts should be a multiple of expert model parallel_size."  # arguments.py L1027

    # torch_dcp (torch.distributed.checkpoint) checkpointing format checks.
    if args.ckpt_format == "torch_dcp":  # arguments.py L1041
        assert args.use_torch_fsdp2, "--ckpt-format torch_dcp is only tested with FSDP."  # arguments.py L1042
        assert args.tensor_model_parallel_size <= 1, \
            "--ckpt-format torch_dcp is not tested with megatron tensor parallelism."  # arguments.py L1043
        assert args.pipeline_model_parallel_size <= 1, \
            "--ckpt-format torch_dcp is not tested with megatron pipeline parallelism."  # arguments.py L1045

    # fsdp_dtensor checkpointing format checks.
    if args.ckpt_format == "fsdp_dtensor":  # arguments.py L1049
        assert args.use_megatron_fsdp, "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP."  # arguments.py L1050

    # Make sure all functionality that requires Gloo process groups is disabled.
    if not args.enable_gloo_process_groups:  # arguments.py L1095
        if args.use_distributed_optimizer:  # arguments.py L1096
            # If using distributed optimizer, must use distributed checkpointing.
            assert args.use_dist_ckpt  # arguments.py L1100

            if args.dist_ckpt_optim_fully_reshardable:  # arguments.py L1102
                assert not args.distrib_optim_fully_reshardable_mem_efficient, \
                    '--distrib-optim-fully-reshardable-mem-efficient requires -enable-gloo-process-groups'  # arguments.py L1103

    # Inference args
    if args.inference_batch_times_seqlen_threshold > -1:  # arguments.py L1147
        assert args.pipeline_model_parallel_size > 1, \
            "--inference-batch-times-seqlen-threshold requires setting --pipeline-model-parallel-size > 1."  # arguments.py L1148
        assert (
            args.cuda_graph_impl == "none"
        ), "Pipeline-parallel microbatched inference is incompatible with CUDA graphs"  # arguments.py L1150

    if args.cuda_graph_impl == "local" and args.expert_model_parallel_size > 1:  # arguments.py L1158
        assert args.moe_pad_experts_for_cuda_graph_inference, \
            "--moe-pad-experts-for-cuda-graph-inference must be set when using CUDA graphs with expert parallelism"  # arguments.py L1159

    # Muon optimizer check
    if 'muon' in args.optimizer:  # arguments.py L1178
        assert not args.overlap_grad_reduce, "Muon optimizer does not support overlap grad reduce for now."  # arguments.py L1181
        assert not args.overlap_param_gather, "Muon optimizer does not support overlap param gather for now."  # arguments.py L1182

        assert not args.use_distributed_optimizer, "Muon optimizer does not support distributed optimizer for now."  # arguments.py L1184
        assert not args.use_torch_fsdp2, "Muon optimizer does not support Torch-FSDP2 for now."  # arguments.py L1185
        assert not args.use_megatron_fsdp, "Muon optimizer does not support Megatron-FSDP for now."  # arguments.py L1186
        assert args.ckpt_format in ["torch", "torch_dist"], "Muon optimizer supports torch and torch_dist checkpoint format."  # arguments.py L1187

    # CUDA Graphs
    if args.cuda_graph_impl != "none":  # arguments.py L1240
        if args.cuda_graph_impl == "transformer_engine":  # arguments.py L1247
            assert (
                "expandable_segments:True" not in env.get("PYTORCH_CUDA_ALLOC_CONF", "")
                or env.get("NCCL_GRAPH_REGISTER", "") == "0"
            ), (
                "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using "
                "CUDA Graph with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
            )  # arguments.py L1248

    if args.multi_latent_attention:  # arguments.py L1265
        assert not args.group_query_attention, "Group query attention is mutually exclusive with multi latent attention."  # arguments.py L1266

    _microbatch_calculator(args)
    _model_parallel_groups(args)
    return args


def _microbatch_calculator(args: argparse.Namespace) -> None:
    """The micro-batch calculator Megatron-LM builds after validate_args
    (``megatron/training/global_vars.py`` L93-100 ``init_num_microbatches_calculator``): the
    constant one (``megatron/core/num_microbatches_calculator.py`` L219-226, its constructor
    L315-350); ``args.num_microbatches`` is its ``get()``. The ramp-up calculator (with
    ``--rampup-batch-size``) is not ported (module docstring)."""
    if args.rampup_batch_size is not None:  # num_microbatches_calculator.py L219: ramp-up
        args.num_microbatches = None
        return
    global_batch_size = args.global_batch_size
    micro_batch_size = args.micro_batch_size
    data_parallel_size = args.data_parallel_size
    micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size  # num_microbatches_calculator.py L324
    if args.decrease_batch_size_if_needed:  # num_microbatches_calculator.py L325
        running_global_batch_size = (  # num_microbatches_calculator.py L326 (_round, L261-263)
            global_batch_size // micro_batch_times_data_parallel_size
        ) * micro_batch_times_data_parallel_size
        assert running_global_batch_size % micro_batch_times_data_parallel_size == 0  # num_microbatches_calculator.py L329
        num_micro_batches = (  # num_microbatches_calculator.py L336
            running_global_batch_size // micro_batch_times_data_parallel_size
        )
    else:
        assert global_batch_size % micro_batch_times_data_parallel_size == 0, (  # num_microbatches_calculator.py L340
            'global batch size ({}) is not divisible by micro batch size ({})'
            ' times data parallel size ({})'.format(
                global_batch_size, micro_batch_size, data_parallel_size
            )
        )
        num_micro_batches = global_batch_size // micro_batch_times_data_parallel_size  # num_microbatches_calculator.py L347
    assert (
        num_micro_batches >= 1
    ), 'number of microbatches should be at least 1, got {}.'.format(num_micro_batches)  # num_microbatches_calculator.py L348
    args.num_microbatches = num_micro_batches


def _model_parallel_groups(args: argparse.Namespace) -> None:
    """The layout checks of megatron-core's ``initialize_model_parallel``
    (``megatron/core/parallel_state.py``), with the arguments Megatron-LM's
    ``_initialize_distributed`` passes it (``megatron/training/initialize.py`` L364-385);
    the rank groups come from megatron-core's own ``RankGenerator``. Nothing is created."""
    from megatron.core.parallel_state import RankGenerator

    world_size = args.world_size
    tensor_model_parallel_size = args.tensor_model_parallel_size
    pipeline_model_parallel_size = args.pipeline_model_parallel_size
    context_parallel_size = args.context_parallel_size
    expert_model_parallel_size = args.expert_model_parallel_size
    expert_tensor_parallel_size = args.expert_tensor_parallel_size
    order = 'tp-cp-ep-dp-pp' if not args.use_tp_pp_dp_mapping else 'tp-cp-ep-pp-dp'  # initialize.py L378
    model_size = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size  # parallel_state.py L738
    data_parallel_size: int = world_size // model_size  # parallel_state.py L743

    decoder_rank_generator = RankGenerator(  # parallel_state.py L775
        tp=tensor_model_parallel_size,
        ep=1,
        dp=data_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        order=order,
        rank_offset=0,
    )

    # Build expert rank generator
    if expert_tensor_parallel_size is None:  # parallel_state.py L786
        expert_tensor_parallel_size = tensor_model_parallel_size
    expert_tensor_model_pipeline_parallel_size = (  # parallel_state.py L788
        expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size
    )
    expert_data_parallel_size = world_size // expert_tensor_model_pipeline_parallel_size  # parallel_state.py L791
    if world_size % expert_tensor_model_pipeline_parallel_size != 0:
        raise RuntimeError(  # parallel_state.py L792
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size ({expert_tensor_model_pipeline_parallel_size})"
        )

    expert_decoder_rank_generator = RankGenerator(  # parallel_state.py L798
        tp=expert_tensor_parallel_size,
        ep=expert_model_parallel_size,
        dp=expert_data_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=1,
        order=order,
        rank_offset=0,
    )

    assert (  # parallel_state.py L808
        order.endswith("pp")
        or pipeline_model_parallel_size == 1
        or expert_data_parallel_size == data_parallel_size
    ), "When not using pp-last rank ordering, the data parallel size of the attention and moe layers must be the same"

    assert decoder_rank_generator.get_ranks("pp") == expert_decoder_rank_generator.get_ranks(
        "pp"
    ), f"Pipeline parallel groups are expected to be the same for Non-Expert and Expert part, \
    but got {decoder_rank_generator.get_ranks('pp')} and {expert_decoder_rank_generator.get_ranks('pp')}"  # parallel_state.py L814

    assert (  # parallel_state.py L833
        data_parallel_size * context_parallel_size
    ) % args.num_distributed_optimizer_instances == 0, (
        "Data parallel size should be divisible by partial DistOpt shard factor"
    )

    if args.hybrid_context_parallel:  # parallel_state.py L938
        for ranks_with_cp in decoder_rank_generator.get_ranks('dp-cp'):
            assert (
                len(ranks_with_cp) % 2 == 0
            ), "Hybrid context parallel requires an even number of ranks"  # parallel_state.py L941
