"""A framework's run read back, and what a plan needs to run in a framework.

The targets themselves, the plan space each framework executes, are
:mod:`autopar.targets` (``TARGETS``, ``target_support``, re-exported here);
:class:`FrameworkRun` is what a reader (:mod:`autopar.frameworks.megatron`,
``torchtitan``, ``deepspeed``) makes of a framework's configuration, and
:func:`outside_target` says why a plan is outside a target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.contract.plan import Layout, recompute_counts
from autopar.contract.support import unsupported
from autopar.targets import FRAMEWORKS, TARGETS, target_support
from autopar.techniques.recompute_modes import mode_recomputing

__all__ = ["TARGETS", "FRAMEWORKS", "target_support", "FrameworkRun", "outside_target",
           "megatron_block_layers", "torchrun_line"]


@dataclass(frozen=True)
class FrameworkRun:
    """One training run as a framework's configuration states it, in autopar's terms.

    framework: "megatron" | "torchtitan" | "deepspeed".
    layout: the parallel layout (tp, pp, dp, micro_batch_size, zero_stage, schedule,
        virtual_stages, sequence_parallel, dtype, ep; ``recompute`` when one mode covers every
        layer, else None and :attr:`recompute` lists them).
    stage_layers: per model chunk [first, last) layers (``Plan.stage_layers``), or None for
        the framework's even split.
    recompute: the mode of every layer (length L), or None when ``layout.recompute`` holds.
    model: the model's shape, Megatron's names: num_layers, hidden_size,
        num_attention_heads, ffn_hidden_size, num_query_groups, seq_length (the longest
        sequence, Megatron-LM's --max-position-embeddings), vocab_size, swiglu (bool),
        untied (bool), dropout; for a mixture of experts num_experts, moe_router_topk,
        moe_ffn_hidden_size (:func:`~autopar.frameworks.megatron_moe.read_moe_flags`);
        absent keys were not stated.
    global_batch_size: B sequences per step, or None.
    seq_len: s tokens per sequence, or None.
    ignored: the flags or keys read but not priced (data, optimiser, logging ...), and
        notes on how a stated value was read.
    attention: the attention kernel the configuration runs ("math" or "flash":
        :attr:`cost_models.hardware.Cluster.attention`), or None for the cluster's (the
        model's own code decides: DeepSpeed).
    """

    framework: str
    layout: Layout
    stage_layers: list[list[int]] | None = None
    recompute: list[str] | None = None
    model: dict = field(default_factory=dict)
    global_batch_size: int | None = None
    seq_len: int | None = None
    ignored: list[str] = field(default_factory=list)
    attention: str | None = None

    def recompute_modes(self, num_layers: int) -> list[str]:
        """The mode of each of ``num_layers`` layers ("none" when nothing was stated)."""
        if self.recompute is not None:
            return list(self.recompute)
        return [self.layout.recompute or "none"] * num_layers


def megatron_block_layers(recompute: list[str], stage_layers: list[list[int]]) -> int | None:
    """k when ``recompute`` is Megatron's block method over ``stage_layers``: full on the
    first min(k, n) layers of every chunk and "none" elsewhere (k = 0: no recompute); None
    when it is not (a mix of granularities, or a full layer after a plain one)."""
    nothing, layer = mode_recomputing("nothing").name, mode_recomputing("layer").name
    if set(recompute) - {nothing, layer}:
        return None
    counts = []
    for lo, hi in stage_layers:
        modes = recompute[lo:hi]
        k = modes.count(layer)
        if modes != [layer] * k + [nothing] * (len(modes) - k):
            return None
        counts.append((k, hi - lo))
    k = max((c for c, _ in counts), default=0)
    return k if all(c == min(k, n) for c, n in counts) else None


def outside_target(plan, target: str) -> str | None:
    """Why ``plan`` (a :class:`~autopar.contract.plan.Plan`) is outside what ``target`` executes, or
    None: the precision and attention kernel it would run in, then the fields of
    :func:`autopar.contract.support.unsupported` (schedule, ZeRO stage, v, sequence parallelism,
    dtype, recompute modes, tp), ep > 1 where the target runs no expert parallelism
    (:attr:`~autopar.contract.support.RuntimeSupport.expert_parallel`), a MoE model at tp > 1
    where it does not run one (``moe_tp``), then the key/value heads, recompute layout and
    stage split against :data:`TARGETS` (placements are not checked: a framework with a fixed TP plan
    runs its own, Megatron's). The message says to re-plan with the target."""
    support = target_support(target)
    fix = f"; plan with --target {target} (autopar.plan(..., target={target!r}))"
    grouped = _grouped_layers(plan, target)
    if grouped:
        return grouped
    if plan.dtype == "bf16" and support.dtype_for("bf16", plan.tp, plan.pp, plan.dp) != "bf16":
        return (f"{target} trains bf16 with tp or pp > 1 only under FSDP (dp > 1): this "
                f"plan would run in fp32{fix}")
    kernels = support.kernels_in(plan.dtype)
    if kernels and plan.attention_kernel not in kernels:
        return (f"{target} runs {' or '.join(kernels)} attention in {plan.dtype}, the plan is "
                f"priced with {plan.attention_kernel} attention{fix}")
    if not kernels and plan.attention is not None and \
            plan.attention != plan.cluster.get("attention", "math"):
        return (f"{target} runs the model's own attention, the cluster's "
                f"{plan.cluster.get('attention', 'math')} kernel; the plan is priced with "
                f"{plan.attention}{fix}")
    problem = unsupported(plan, support)  # the runtime's own check, worded for the target
    if problem is not None:
        return problem.message(target) + fix
    ep = getattr(plan, "ep", 1)
    if ep > 1 and not support.expert_parallel:
        return (f"{target} cannot run ep={ep}: autopar does not emit expert parallelism "
                f"for it (autopar.techniques.expert_parallel.FRAMEWORK_FLAGS){fix}")
    if plan.tp > 1 and not support.moe_tp and _experts(plan.model_config) and not (
            ep > 1 and plan.sequence_parallel):
        return (f"{target} runs a mixture-of-experts model at tp > 1 as autopar prices it "
                f"only with ep > 1 and sequence parallelism (its experts on sequence shards, "
                f"the EP group spanning TP); the plan has tp={plan.tp}, ep={ep}, "
                f"sequence_parallel={plan.sequence_parallel}{fix}")
    kv = _kv_heads(plan.model_config)
    if support.placements == "megatron" and kv and kv % plan.tp:
        return (f"{target} splits whole key/value heads over TP (megatron-core: "
                f"num_query_groups % tp == 0): {kv} do not divide over tp={plan.tp}{fix}")
    uniform = len(set(plan.recompute)) <= 1
    if support.recompute_layout == "uniform" and not uniform:
        return f"{target} runs one recompute mode for every layer, the plan mixes them{fix}"
    if support.recompute_layout == "block" and not uniform and (
            plan.virtual_stages > 1 or megatron_block_layers(plan.recompute,
                                                              plan.stage_layers) is None):
        counts = recompute_counts(plan.recompute)
        return (f"{target} recomputes the first k layers of every stage fully (--recompute-"
                f"method block) or every layer selectively; the plan's per-layer recompute "
                f"({counts}, by stage {_by_stage(plan)}) is neither{fix}")
    if support.even_stages:
        from autopar.contract.stages import even_stage_layers
        if plan.stage_layers != even_stage_layers(len(plan.recompute), plan.pp,
                                                  plan.virtual_stages):
            return f"{target} splits the layers evenly over the stages, the plan does not{fix}"
    return None


def torchrun_line(plan) -> str:
    """The ``torchrun`` launch of ``plan``'s GPUs: its cluster's GPUs per node, the nodes
    the plan uses (every rank on one node for a plan smaller than a node)."""
    per_node = plan.cluster.get("gpus_per_node") or plan.num_gpus
    per_node = min(per_node, plan.num_gpus)
    return (f"torchrun --nnodes {-(-plan.num_gpus // per_node)} --nproc-per-node {per_node} "
            "--node-rank <this node> --master-addr <node 0> --master-port 29500")


def _grouped_layers(plan, target: str) -> str | None:
    """Why ``target`` cannot run a plan whose layers are groups of the model's transformer
    layers (:mod:`autopar.graph.layer_groups`: its layers differ), or None."""
    c = plan.model_config
    layers = c.get("num_hidden_layers", c.get("n_layer", c.get("num_layers")))
    if not isinstance(layers, int) or layers == len(plan.recompute):
        return None
    return (f"the plan's {len(plan.recompute)} layers are groups of the model's {layers} "
            f"transformer layers, which are not all alike (autopar.graph.layer_groups); "
            f"{target}'s flags count transformer layers of one kind, so autopar does not "
            "translate this plan; run it with autopar (autopar verify, autopar.parallelize)")


def _experts(model_config: dict) -> bool:
    """``model_config`` states a mixture of experts (a key of :data:`~autopar.frameworks.
    model_shape.MOE_KEYS` above 1)."""
    from autopar.frameworks.model_shape import MOE_KEYS

    return any(isinstance(model_config.get(k), int) and model_config[k] > 1 for k in MOE_KEYS)


def _kv_heads(model_config: dict) -> int | None:
    """The key/value heads ``model_config`` states (its query heads without grouped-query
    attention), or None when its shape cannot be read."""
    from autopar.frameworks.model_shape import model_shape

    try:
        return model_shape(model_config).get("num_query_groups")
    except (ValueError, KeyError, TypeError):
        return None


def _by_stage(plan) -> str:
    """Per model chunk, its recompute modes in order, e.g. "[full×2 none×4] [none×6]"."""
    out = []
    for lo, hi in plan.stage_layers:
        runs, modes = [], plan.recompute[lo:hi]
        for mode in modes:
            if runs and runs[-1][0] == mode:
                runs[-1][1] += 1
            else:
                runs.append([mode, 1])
        out.append("[" + " ".join(f"{m}×{n}" for m, n in runs) + "]")
    return " ".join(out[:8]) + (" ..." if len(out) > 8 else "")
