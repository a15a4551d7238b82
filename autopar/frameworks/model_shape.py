"""A model's shape in Megatron-LM's names, and the model built back from one.

Frameworks state a model by its shape (``--num-layers 96 --hidden-size 12288 ...``), so a
plan is emitted with its model's shape and a framework's run is priced on a model built
from the shape it states: autopar's :class:`~autopar.models.GPT` (GPT-2/3: LayerNorm, GELU,
a 4h MLP, learned positions, tied head) or, with SwiGLU, a Llama-family model from
``transformers`` (RMSNorm, rotary positions, grouped-query attention, untied head), both on
the meta device.
"""

from __future__ import annotations

import torch

from autopar.models import GPT, GPTConfig

__all__ = ["model_shape", "build_model", "model_problem", "SHAPE_KEYS", "MOE_KEYS"]

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config keys that make a model a mixture of experts when > 1 (Hugging Face's Mixtral,
Qwen-MoE and OLMoE, DeepSeek-V2/V3, and others)."""

SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "num_query_groups", "seq_length", "vocab_size", "swiglu", "untied", "dropout")
"""The shape's keys (Megatron-LM's flag names with underscores; swiglu and untied: bool;
dropout: the hidden dropout probability, which the cost model prices as a saved mask)."""


def model_shape(model_config: dict) -> dict:
    """The shape of ``model_config`` (``Plan.model_config``: a :class:`GPTConfig` dict or a
    Hugging Face config dict) in :data:`SHAPE_KEYS`. Raises ValueError for a config that
    states no layer count, hidden size or head count."""
    c = model_config
    if "n_layer" in c and "n_embd" in c:  # autopar's GPT, nanoGPT, HF GPT-2
        h = c["n_embd"]
        shape = {"num_layers": c["n_layer"], "hidden_size": h, "num_attention_heads": c["n_head"],
                 "ffn_hidden_size": c.get("n_inner") or 4 * h,
                 "num_query_groups": c["n_head"],
                 "seq_length": c.get("block_size") or c.get("n_positions"),
                 "vocab_size": c["vocab_size"], "swiglu": False, "untied": False,
                 "dropout": c.get("dropout", c.get("resid_pdrop", 0.0))}
    elif "num_hidden_layers" in c and "hidden_size" in c:  # Llama family
        shape = {"num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
                 "num_attention_heads": c["num_attention_heads"],
                 "ffn_hidden_size": c.get("intermediate_size") or 4 * c["hidden_size"],
                 "num_query_groups": c.get("num_key_value_heads") or c["num_attention_heads"],
                 "seq_length": c.get("max_position_embeddings"), "vocab_size": c["vocab_size"],
                 "swiglu": c.get("hidden_act", "silu") == "silu",
                 "untied": not c.get("tie_word_embeddings", True),
                 # transformers 5 keeps it in rope_parameters, 4.x at the top level
                 "rope_theta": c.get("rope_theta") or (c.get("rope_parameters") or {}).get(
                     "rope_theta"),
                 "norm_eps": c.get("rms_norm_eps")}
    else:
        raise ValueError(f"cannot read a model shape from config keys {sorted(c)[:12]}; "
                         "autopar emits framework configurations for GPT-2/3 and "
                         "Llama-family models")
    return {k: v for k, v in shape.items() if v is not None}


def model_problem(model_config: dict, framework: str) -> str | None:
    """Why ``framework`` would train another model than ``model_config``, or None: a
    mixture-of-experts model (:data:`MOE_KEYS`) that the framework's configuration does not
    express (Megatron-LM: :func:`~autopar.frameworks.megatron_moe.moe_model_problem`;
    torchtitan: its MoE models are its own deepseek_v3, qwen3 and llama4 definitions, and
    autopar emits its llama3; DeepSpeed: its MoE is its own layer,
    ``deepspeed.moe.layer.MoE``, which the model code must call), or for torchtitan a
    model its Llama 3 definition (``torchtitan/models/llama3``: RMSNorm, SwiGLU, rotary
    positions, an untied head, no biases) does not reproduce: a GPT-2/3 model, a tied head,
    biased projections."""
    c = model_config
    experts = {k: c[k] for k in MOE_KEYS if isinstance(c.get(k), int) and c[k] > 1}
    if experts and framework == "megatron":
        from autopar.frameworks.megatron_moe import moe_model_problem

        return moe_model_problem(c)
    if experts:
        key, n = next(iter(experts.items()))
        why = ("torchtitan 0.2.2 runs mixture-of-experts layers only in its own deepseek_v3, "
               "qwen3 and llama4 model definitions; autopar emits its llama3 model"
               if framework == "torchtitan" else
               "DeepSpeed's mixture of experts is its own layer (deepspeed.moe.layer.MoE) "
               "that the model code calls, not this model's experts module")
        return (f"a mixture-of-experts model ({key}={n}): {why}, so the configuration would "
                "train another model; emit it for Megatron-LM or run it with autopar")
    if framework != "torchtitan":
        return None
    try:
        shape = model_shape(c)
    except ValueError as exc:
        return str(exc)
    if not shape["swiglu"]:
        return ("torchtitan 0.2.2 defines Llama-family models (llama3: RMSNorm, SwiGLU, rotary "
                "positions, untied head), not this GPT-2/3 model (LayerNorm, GELU, learned "
                "positions, tied head); train it with Megatron-LM or DeepSpeed, or plan a "
                "Llama-family model")
    if not shape["untied"]:
        return ("torchtitan's llama3 model has an untied output head; this model ties it to "
                "the embedding (tie_word_embeddings)")
    if c.get("attention_bias") or c.get("mlp_bias"):
        return "torchtitan's llama3 model has no biases; this model's projections have them"
    return None


def build_model(shape: dict) -> tuple[torch.nn.Module, str]:
    """The model ``shape`` states, on the meta device, and its name. Without SwiGLU:
    autopar's GPT (ValueError unless ffn_hidden_size is 4·hidden_size and the query groups
    equal the heads, as GPT has); with SwiGLU: ``transformers``' LlamaForCausalLM
    (ImportError naming the package when it is missing). Needs num_layers, hidden_size,
    num_attention_heads, seq_length and vocab_size (ValueError naming the missing flag)."""
    need = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
            "num_attention_heads": "--num-attention-heads", "seq_length": "--seq-length",
            "vocab_size": "--vocab-size"}
    missing = [flag for key, flag in need.items() if not shape.get(key)]
    if missing:
        raise ValueError(f"the model's shape needs {', '.join(missing)}; give them (or the "
                         "model with --model)")
    L, h, a = shape["num_layers"], shape["hidden_size"], shape["num_attention_heads"]
    s, V = shape["seq_length"], shape["vocab_size"]
    ffn, groups = shape.get("ffn_hidden_size") or 4 * h, shape.get("num_query_groups") or a
    name = f"megatron-shape L{L} h{h} a{a}"
    if not shape.get("swiglu"):
        if ffn != 4 * h or groups != a:
            raise ValueError(f"--ffn-hidden-size {ffn} / --num-query-groups {groups}: autopar's "
                             f"GPT has a 4h MLP ({4 * h}) and one key/value head per query "
                             "head; add --swiglu for a Llama-family model, or give --model")
        with torch.device("meta"):
            return GPT(GPTConfig(n_layer=L, n_head=a, n_embd=h, vocab_size=V, block_size=s,
                                 dropout=shape.get("dropout", 0.0))), name
    try:
        import transformers
    except ImportError:
        raise ImportError("a SwiGLU (Llama-family) shape is built with transformers; "
                          "pip install 'transformers>=5,<6' or give --model") from None
    common = dict(hidden_size=h, num_hidden_layers=L, num_attention_heads=a,
                  num_key_value_heads=groups, vocab_size=V, max_position_embeddings=s,
                  tie_word_embeddings=not shape.get("untied", True))
    if shape.get("num_experts"):  # every layer MoE (megatron_moe.read_moe_flags): a Mixtral
        config = transformers.MixtralConfig(
            **common, intermediate_size=shape.get("moe_ffn_hidden_size") or ffn,
            num_local_experts=shape["num_experts"],
            num_experts_per_tok=shape.get("moe_router_topk", 2))
        name += f" moe E{shape['num_experts']} k{shape.get('moe_router_topk', 2)}"
    else:
        config = transformers.LlamaConfig(**common, intermediate_size=ffn)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, name + " swiglu"
