"""Megatron-LM's mixture-of-experts flags: a MoE model and expert parallelism, written and read.

A Hugging Face MoE config maps to megatron-core's MoE layer (``transformer/moe``,
core_v0.16.1) through these flags (Megatron-LM ``megatron/training/arguments.py``; the
``TransformerConfig`` field of the same name with underscores, ``--num-experts`` being
``num_moe_experts``):

* the model: ``--num-experts`` E, ``--moe-router-topk`` k, ``--moe-ffn-hidden-size`` F (the
  expert MLP's width), ``--moe-shared-expert-intermediate-size`` (the shared experts' total
  width, ``--moe-shared-expert-gate`` when a sigmoid gate scales them),
  ``--moe-layer-freq`` (1: every layer MoE; else a Python list expression, 1 a MoE layer
  and 0 a dense one: ``"([0]*1+[1]*3)"``, arguments.py ``moe_freq_type``),
  ``--moe-router-pre-softmax`` when the top-k probabilities are not renormalised (softmax
  over all E, then top-k; without it megatron-core takes the top-k logits and softmaxes
  them, which equals Mixtral's softmax, top-k and renormalise);
* expert parallelism (autopar's ep, :mod:`autopar.techniques.expert_parallel`):
  ``--expert-model-parallel-size`` ep, ``--expert-tensor-parallel-size 1``,
  ``--moe-token-dispatcher-type alltoall`` (the all-to-all dispatch autopar prices; the
  default is ``allgather``) and ``--moe-grouped-gemm`` (the experts as grouped GEMMs, as
  autopar prices them; arguments.py L852-854 asks for compute capability 8 or more).

Megatron-LM's rules at core_v0.16.1: arguments.py ``validate_args`` L1024-1027 (EP needs
``--num-experts`` and E % ep == 0) and L410-411 (expert-TP defaults to tp); megatron-core's
``MoELayer.forward`` (``transformer/moe/moe_layer.py``) raises in training when tp > 1
without ``--sequence-parallel``; ``TransformerConfig.__post_init__``: a biased linear under
MoE needs expert-TP 1. Under TP Megatron-LM's experts run split over the TP ranks
(expert-TP = tp: tokens all-gathered over TP, F/tp each) or whole on each rank's sequence
shard (expert-TP 1, the expert mesh folding EP x expert-TP over the tp x cp x dp ranks:
``parallel_state.initialize_model_parallel``, "MoE Parallel Folding", Liu et al. 2025),
while autopar prices the routed experts on each TP rank's tokens only under expert
parallelism (ep > 1: the EP group spans TP, ``autopar.techniques.expert_parallel.
experts_token_parallel``; the ranks of an EP group are consecutive, as in Megatron-Core's
expert mesh with expert-TP 1) and whole on every TP rank for all tokens at ep = 1. So a
MoE plan at tp > 1 runs in Megatron-LM as priced with ep > 1 and sequence parallelism
(emitted with ``--expert-tensor-parallel-size 1``); others are refused
(:func:`moe_plan_problem`; the megatron target's ``moe_tp`` is False, so the planner
proposes only those) and so are such flags (:func:`read_moe_flags`).

Families: Mixtral (``num_local_experts``) maps; DeepSeek-V2/V3 (multi-latent attention,
sigmoid group-limited routing), Qwen2-MoE (q/k/v biases), Qwen3-MoE (q/k RMSNorm) and
families without these keys are refused by name (:func:`moe_model_problem`).
"""

from __future__ import annotations

__all__ = ["moe_config", "moe_model_problem", "moe_plan_problem", "moe_model_args",
           "moe_parallel_args", "read_moe_flags", "MOE_INT", "MOE_TEXT", "MOE_BOOL"]

MOE_INT = ("expert-model-parallel-size", "expert-tensor-parallel-size", "num-experts",
           "moe-router-topk", "moe-ffn-hidden-size", "moe-shared-expert-intermediate-size")
MOE_TEXT = ("moe-token-dispatcher-type", "moe-layer-freq")
MOE_BOOL = ("moe-grouped-gemm", "moe-router-pre-softmax", "moe-shared-expert-gate")
"""The MoE flags :func:`read_moe_flags` reads (arguments.py ``_add_moe_args``)."""

_REFUSED_FAMILIES = {
    "deepseek_v3": "DeepSeek-V3's multi-latent attention and sigmoid group-limited routing",
    "deepseek_v2": "DeepSeek-V2's multi-latent attention and group-limited routing",
    "qwen2_moe": "Qwen2-MoE's q/k/v projection biases (Megatron-LM's --add-qkv-bias, which "
                 "autopar's emitter does not write)",
    "qwen3_moe": "Qwen3-MoE's q/k RMSNorm and head size (Megatron-LM's --qk-layernorm and "
                 "--kv-channels, which autopar's emitter does not write)",
}


def moe_config(c: dict) -> dict | None:
    """The MoE shape of Hugging Face config ``c`` in Megatron-LM's names, or None for a
    dense model: num_experts E, moe_router_topk k, moe_ffn_hidden_size F,
    moe_shared_expert_intermediate_size (0: none), shared_gate, moe_layer_freq (per layer 1
    MoE, 0 dense), pre_softmax (top-k probabilities not renormalised)."""
    E = (c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
         or c.get("moe_num_experts"))
    if not isinstance(E, int) or E <= 1:
        return None
    L = c.get("num_hidden_layers")
    F = c.get("moe_intermediate_size") or c.get("intermediate_size")
    shared = c.get("shared_expert_intermediate_size") or (
        (c.get("n_shared_experts") or 0) * (c.get("moe_intermediate_size") or 0))
    dense = set(c.get("mlp_only_layers") or ()) | set(range(c.get("first_k_dense_replace") or 0))
    step = c.get("decoder_sparse_step") or 1
    freq = [0 if i in dense or (i + 1) % step else 1 for i in range(L or 0)]
    return {"num_experts": E, "moe_router_topk": c.get("num_experts_per_tok") or 2,
            "moe_ffn_hidden_size": F, "moe_shared_expert_intermediate_size": shared,
            "shared_gate": bool(c.get("shared_expert_intermediate_size")),
            "moe_layer_freq": freq, "pre_softmax": c.get("norm_topk_prob", True) is False}


def moe_model_problem(c: dict) -> str | None:
    """Why Megatron-LM's flags would build another model than MoE config ``c``, or None
    (a dense model, or a family whose MoE layer they express: module docstring)."""
    moe = moe_config(c)
    if moe is None:
        return None
    family = c.get("model_type", "")
    if family in _REFUSED_FAMILIES:
        return (f"{_REFUSED_FAMILIES[family]}: Megatron-LM's flags as autopar writes them would "
                "build another model; train it with autopar (autopar.parallelize)")
    if "num_local_experts" not in c:
        return (f"a mixture-of-experts model of family {family or '?'}: autopar maps Mixtral's "
                "MoE layer to Megatron-LM's flags, not this one's")
    if c.get("sliding_window"):
        return (f"sliding-window attention (sliding_window={c['sliding_window']}): Megatron-"
                "LM's flags as autopar writes them build full causal attention")
    if c.get("router_jitter_noise") or c.get("output_router_logits"):
        return ("router jitter noise or a router loss (output_router_logits): autopar prices "
                "neither; set router_jitter_noise=0 and output_router_logits=False")
    return None


def moe_plan_problem(plan) -> str | None:
    """Why Megatron-LM would not run ``plan`` of a MoE model as autopar prices it, or None:
    tp > 1 without expert parallelism or without sequence parallelism (module docstring:
    under expert-TP 1 Megatron-LM's experts run on each TP rank's sequence shard, priced
    so only when the EP group spans TP, ep > 1; megatron-core's MoE layer needs SP)."""
    if moe_config(plan.model_config) is None or plan.tp == 1 or (
            getattr(plan, "ep", 1) > 1 and plan.sequence_parallel):
        return None
    return (f"a mixture-of-experts model at tp={plan.tp} with ep={getattr(plan, 'ep', 1)}, "
            f"sequence_parallel={plan.sequence_parallel}: Megatron-LM runs its experts on "
            "sequence shards (expert-TP 1), which autopar prices only with ep > 1 and "
            "sequence parallelism; plan it with tp=1 or ep > 1 (--target megatron does)")


def _freq(freq: list[int]) -> str:
    """``--moe-layer-freq`` of per-layer flags: "1" when every layer is MoE, a run form
    "([0]*k+[1]*m)" when dense layers come first, else a literal list."""
    if all(freq):
        return "1"
    k = freq.index(1) if 1 in freq else len(freq)
    if all(freq[k:]):
        return f"([0]*{k}+[1]*{len(freq) - k})"
    return "[" + ",".join(map(str, freq)) + "]"


def moe_model_args(model_config: dict) -> list[str]:
    """The flags that make Megatron-LM build ``model_config``'s MoE layers ([] for a dense
    model): module docstring."""
    moe = moe_config(model_config)
    if moe is None:
        return []
    out = ["--num-experts", str(moe["num_experts"]), "--moe-router-topk",
           str(moe["moe_router_topk"]), "--moe-ffn-hidden-size", str(moe["moe_ffn_hidden_size"])]
    if moe["moe_shared_expert_intermediate_size"]:
        out += ["--moe-shared-expert-intermediate-size",
                str(moe["moe_shared_expert_intermediate_size"])]
        out += ["--moe-shared-expert-gate"] * moe["shared_gate"]
    if not all(moe["moe_layer_freq"]):
        out += ["--moe-layer-freq", _freq(moe["moe_layer_freq"])]
    out += ["--moe-router-pre-softmax"] * moe["pre_softmax"]
    return out


def moe_parallel_args(plan) -> list[str]:
    """The expert-parallel flags of ``plan`` ([] at ep = 1): ``--expert-model-parallel-size
    ep --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm``."""
    if plan.ep == 1:
        return []
    return ["--expert-model-parallel-size", str(plan.ep), "--expert-tensor-parallel-size", "1",
            "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]


def read_moe_flags(flags: dict, t: int, d: int | None, ignored: list[str]) -> tuple[int, dict]:
    """(ep, the model's MoE shape) that Megatron-LM flags ``flags`` state (t: the TP size,
    d: the data-parallel size when known). Raises ValueError naming the flag: EP without
    ``--num-experts``; E not divisible by ep; ep not dividing d; a dispatcher other than
    alltoall under EP (allgather and flex run other communication, not priced); an
    expert-TP size other than 1 (megatron-core's default is t); MoE with tp > 1; shared
    experts, dense layers or pre-softmax routing, which autopar's priced model (a Mixtral)
    does not have."""
    ep, E = flags.get("expert-model-parallel-size", 1), flags.get("num-experts")
    if E is None:
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} without --num-experts: "
                             "Megatron-LM refuses it (expert parallelism needs experts)")
        return 1, {}
    if E % ep:
        raise ValueError(f"--num-experts {E} is not divisible by --expert-model-parallel-size "
                         f"{ep} (arguments.py validate_args L1027)")
    if d is not None and (t * d) % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {t * d} "
                         "tensor- and data-parallel ranks of a stage; autopar prices EP "
                         "folded over them")
    etp = flags.get("expert-tensor-parallel-size", t)  # ModelParallelConfig: tp when unset
    if etp != 1:
        raise ValueError(f"--expert-tensor-parallel-size {etp}"
                         + ("" if "expert-tensor-parallel-size" in flags else " (the tp size, "
                            "megatron-core's default)") + ": autopar prices experts whole on "
                         "each rank (expert-TP 1); give --expert-tensor-parallel-size 1")
    if t > 1 and (ep == 1 or not flags.get("sequence-parallel")):
        raise ValueError(f"--num-experts {E} with --tensor-model-parallel-size {t} and "
                         f"--expert-model-parallel-size {ep}"
                         + ("" if flags.get("sequence-parallel") else " without --sequence-parallel")
                         + ": Megatron-LM runs the experts on sequence shards (expert-TP 1), "
                         "which autopar prices with ep > 1 and sequence parallelism only")
    dispatcher = flags.get("moe-token-dispatcher-type", "allgather")
    if ep > 1 and dispatcher != "alltoall":
        raise ValueError(f"--moe-token-dispatcher-type {dispatcher}: autopar prices the "
                         "alltoall dispatcher only (allgather and flex/DeepEP move other data); "
                         "give --moe-token-dispatcher-type alltoall")
    for flag in ("moe-shared-expert-intermediate-size", "moe-router-pre-softmax"):
        if flags.get(flag):
            raise ValueError(f"--{flag}: autopar prices a Mixtral-like MoE read from flags "
                             "(no shared experts, renormalised top-k); give the model itself")
    if flags.get("moe-layer-freq", "1") != "1":
        raise ValueError(f"--moe-layer-freq {flags['moe-layer-freq']}: autopar prices every "
                         "layer MoE when it builds the model from flags; give the model itself")
    if flags.get("moe-grouped-gemm"):
        ignored.append("--moe-grouped-gemm: the experts priced as grouped GEMMs, as always")
    return ep, {"num_experts": E, "moe_router_topk": flags.get("moe-router-topk", 2),
                "moe_ffn_hidden_size": flags.get("moe-ffn-hidden-size")}
