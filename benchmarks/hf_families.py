"""Every causal-LM family ``transformers`` ships, sorted by what the model zoo does with it.

``python benchmarks/model_zoo.py --all`` walks ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (196
model types in transformers 5.24). A family is, by these rules in this order:

* **out of scope**, with the reason, when its causal-LM class is not a decoder-only
  language model: the decoder half of an encoder-decoder family (the config says
  ``is_encoder_decoder`` or the family has a seq2seq LM), an encoder trained as a
  masked LM whose ``*ForCausalLM`` is a decoder mode (the family has a masked-LM head:
  BERT, RoBERTa, XLM ...), a multimodal model (a vision or audio config, or an
  image-text-to-text head; its text decoder, where transformers has one, is a family of
  its own: ``gemma3`` → ``gemma3_text``), or a family listed in :data:`NOT_DECODER_ONLY`;
* **hybrid** when the tiny model has a recurrent, state-space, convolution or
  linear-attention layer (Mamba, RWKV, xLSTM, Griffin, Gated DeltaNet ...; with or without
  experts): not a transformer decoder, so Megatron's attention/MLP placements do not
  describe it; verified and reported apart;
* **moe** when the tiny model has experts (a parameter or module path with "expert");
* **dense** otherwise.

:func:`tiny_config` sets the tiny sizes on whichever size fields the config class has
(the same ``_hf_extra`` sizes as the zoo's other families), experts to 4 with top-2
routing, and every layer of the same kind where the config has a per-layer pattern of
dense and MoE layers (``first_k_dense_replace`` ...), so the two layers are one template
(mixed layers plan too, as groups: ``autopar/graph/layer_groups.py``; one kind keeps the
rows comparable);
no layer reads another's keys and values (Gemma 3n/4's ``num_kv_shared_layers``: its
default counts layers of the full-size model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Family", "causal_lm_families", "tiny_config", "build_family", "NOT_DECODER_ONLY"]

# causal-LM classes that the mapping rules above do not catch and that are not decoder-only
# LMs trained on next-token loss over one token stream
NOT_DECODER_ONLY = {
    "xlnet": "permutation language model (two-stream attention over a permuted order)",
    "bert-generation": "the encoder-decoder building block of BertGeneration",
    "trocr": "the text decoder of an image-to-text encoder-decoder (TrOCR)",
    "moshi": "multi-stream speech-text model (a depth decoder per audio codebook)",
    "cpmant": "its model attends to the whole sequence whatever the config says "
              "(autopar.hf_models.NOT_CAUSAL)",
    "reformer": "LSH / chunked attention with reversible layers (an encoder family)",
    "gemma4_unified_assistant": "a speculative-decoding drafter: its forward needs the main "
                                "model's inputs_embeds and KV states, not token ids",
}
EXPERTS, TOP_K, MOE_FFN = 4, 2, 64
# per-layer switches between dense and MoE layers, and the value that makes every layer MoE
MOE_EVERY_LAYER = dict(first_k_dense_replace=0, mlp_only_layers=[], decoder_sparse_step=1,
                       moe_layer_freq=1, first_dense_layers=0, num_dense_layers=0,
                       moe_layer_start_index=0, interleave_moe_layer_step=1)


# fields a family's tiny config needs beyond the common sizes, each for the rule its config
# class checks (the error it raised without it)
FIXUPS = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # one kind per layer
    "mamba2": dict(num_heads=8),  # hidden·expand = num_heads·head_dim: 64·2 = 8·16
    "zaya": dict(num_experts_per_tok=1),  # "supports num_experts_per_tok=1 only"
    # input + recurrent + output layers must sum to the layer count (the defaults' 8 + 8
    # run both tiny layers twice); the recurrent one still loops twice
    "dory": dict(n_input_layers=1, n_recurrent_layers=1, n_output_layers=0),
    # compression rates 4 and 128 tokens: at the tiny seq_len 16 the heavily compressed
    # layers' compressor would read nothing; 8 keeps it in the graph
    # its default attention config lacks the RoPE base its attention reads, and clip_qkv
    # None reaches clamp(min=None, max=None) ("clamp called but both min and max are none")
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}),
    "deepseek_v4": dict(compress_rates={"compressed_sparse_attention": 4,
                                        "heavily_compressed_attention": 8}),
}


@dataclass(frozen=True)
class Family:
    """One model type of the causal-LM mapping and the zoo's verdict on its scope."""

    model_type: str
    model_class: str
    group: str
    """"dense", "moe", "hybrid" or "out of scope" (then ``reason`` says why)"""
    reason: str = ""


def _scope_reason(model_type: str, cfg) -> str:
    """Why ``model_type`` is not a decoder-only LM, or "" when it is."""
    from transformers.models.auto import modeling_auto as ma

    if model_type in NOT_DECODER_ONLY:
        return NOT_DECODER_ONLY[model_type]
    if getattr(cfg, "is_encoder_decoder", False) or model_type in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "decoder half of an encoder-decoder family"
    if model_type in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder family (masked LM); its causal LM is a decoder mode"
    multimodal = getattr(ma, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    if model_type in multimodal or any(hasattr(cfg, k) for k in ("vision_config", "audio_config")):
        return "multimodal"
    return ""


def causal_lm_families() -> list[Family]:
    """Every model type of transformers' causal-LM mapping with its group (see the module
    docstring); a config class that cannot be built with its defaults is out of scope
    with its error."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = []
    for model_type, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            cfg = tf.AutoConfig.for_model(model_type)
        except Exception as exc:  # the family's own defaults do not validate
            families.append(Family(model_type, cls, "out of scope",
                                   f"default config does not build: {_first(exc)}"))
            continue
        reason = _scope_reason(model_type, cfg)
        if reason:
            families.append(Family(model_type, cls, "out of scope", reason))
            continue
        try:
            model = build_family(model_type, device="meta")
        except Exception as exc:  # counted unless transformers cannot build it either
            reason = _default_build_error(model_type, cfg)
            group = "out of scope" if reason else "hybrid" if _recurrent_config(cfg) else "dense"
            families.append(Family(model_type, cls, group, reason or f"tiny build: {_first(exc)}"))
            continue
        moe = any("expert" in name.lower() for name, _ in model.named_modules())
        group = "hybrid" if _recurrent(model) else "moe" if moe else "dense"
        families.append(Family(model_type, cls, group))
    return families


RECURRENT = ("Mixer", "Rwkv", "xLSTM", "Recurrent", "Rglru", "ShortConv", "GatedDeltaNet",
             "DeltaAttention", "LightningAttention")
"""Class-name parts of recurrent, state-space and linear-attention layers (Mamba's mixer,
RWKV, xLSTM, Griffin's RG-LRU, LFM's short convolution, Gated DeltaNet, MiniMax's
lightning attention)."""


def _recurrent(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a recurrent, state-space, convolution or linear-attention
    layer (a causal ``nn.Conv1d`` or a class of :data:`RECURRENT`; not GPT-2's ``Conv1D``,
    a Linear)."""
    return any(isinstance(m, torch.nn.Conv1d) or any(k in type(m).__name__ for k in RECURRENT)
               for m in model.modules())


def _recurrent_config(cfg) -> bool:
    """Whether ``cfg``'s per-layer kinds name a recurrent, state-space or linear-attention
    layer (for a family whose tiny model does not build, so :func:`_recurrent` cannot look)."""
    kinds = [str(k) for key in ("layer_types", "layers_block_type")
             for k in (getattr(cfg, key, None) or [])]
    return any(w in k for k in kinds for w in ("linear", "mamba", "hybrid", "recurrent", "conv"))


def _default_build_error(model_type: str, cfg) -> str:
    """"" when transformers builds ``model_type``'s model from its default config (on the
    meta device), else the error: a family transformers cannot build as shipped."""
    import transformers as tf

    try:
        with torch.device("meta"):
            tf.AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # transformers' own error, recorded in the row
        return f"its default config does not build its model in transformers: {_first(exc)}"
    return ""


def _first(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:140].replace("|", "/")


def _has(cfg, key: str) -> bool:
    """Whether ``cfg``'s constructor takes ``key``: an attribute (or an ``attribute_map``
    alias) that is not a read-only property; a per-layer field that refuses to be read as
    one value (Gemma 4's ``head_dim``) counts as absent."""
    prop = getattr(type(cfg), key, None)
    if isinstance(prop, property) and prop.fset is None:
        return False
    try:
        return hasattr(cfg, key) or key in getattr(cfg, "attribute_map", {})
    except Exception:  # noqa: BLE001 - a config's own refusal to read the field
        return False


def _sized(cfg, sizes: dict, vocab: int, layers: int) -> dict:
    """The constructor fields of ``cfg``'s class to change: each of ``sizes`` the class
    has (:func:`_has`), dropout 0, token ids inside the vocabulary, a per-layer type list
    cut to ``layers``, nested dense/MoE sub-configs (DBRX's ``ffn_config``) the same way."""
    fields = {key: value for key, value in sizes.items() if _has(cfg, key)}
    for key in dir(cfg):
        if (("dropout" in key or key.endswith("pdrop")) and _has(cfg, key)
                and isinstance(getattr(cfg, key, None), float)):
            fields[key] = 0.0
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= vocab:
            fields[key] = 0
    own = getattr(type(cfg), "__dataclass_fields__", {})  # fields of its own, not aliases
    kinds = getattr(cfg, "layer_types", None)
    if "layer_types" in own and isinstance(kinds, (list, tuple)) and len(kinds) != layers:
        fields["layer_types"] = list(kinds[:layers])
    mlp_kinds = getattr(cfg, "mlp_layer_types", None)
    sparse = [k for k in mlp_kinds or [] if k != "dense"] if "mlp_layer_types" in own else []
    if sparse:  # every layer MoE, in the family's own word ("sparse", "moe")
        fields["mlp_layer_types"] = [max(set(sparse), key=sparse.count)] * layers
    for key in ("ffn_config", "attn_config"):
        sub = getattr(cfg, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            fields[key] = {**sub.to_dict(), **_sized(sub, sizes, vocab, layers)}
    return fields


def tiny_config(model_type: str, d: dict):
    """``model_type``'s default config (transformers) with the sizes of ``d`` (hidden,
    heads, kv_heads, ffn, layers, vocab, positions) given to its constructor where it has
    the field, dropout off, MoE layers made small and uniform (:data:`EXPERTS` experts,
    top-:data:`TOP_K`, every layer MoE). Given to the constructor, not set afterwards, so
    fields the class derives (layer types, RoPE parameters) follow the new sizes."""
    import transformers as tf

    h, a = d["hidden"], d["heads"]
    kv = a if model_type == "falcon" else d["kv_heads"]  # Falcon-7B's layout: kv = heads
    sizes = dict(hidden_size=h, num_attention_heads=a, num_hidden_layers=d["layers"],
                 intermediate_size=d["ffn"], ffn_hidden_size=d["ffn"], n_inner=d["ffn"],
                 vocab_size=d["vocab"], max_position_embeddings=d["positions"],
                 num_key_value_heads=kv, num_kv_heads=kv, head_dim=h // a,
                 rotary_dim=h // a // 2, num_local_experts=EXPERTS, num_experts=EXPERTS,
                 n_routed_experts=EXPERTS, moe_num_experts=EXPERTS,
                 num_experts_per_tok=TOP_K, moe_top_k=TOP_K, num_experts_per_token=TOP_K,
                 moe_intermediate_size=MOE_FFN, expert_intermediate_size=MOE_FFN,
                 shared_expert_intermediate_size=MOE_FFN, moe_ffn_hidden_size=MOE_FFN,
                 n_group=1, topk_group=1, num_kv_shared_layers=0,
                 # multi-head latent attention (DeepSeek-V2/V3): its head_dim is the RoPE part
                 q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                 v_head_dim=16, **MOE_EVERY_LAYER)
    default = tf.AutoConfig.for_model(model_type)
    fields = {**_sized(default, sizes, d["vocab"], d["layers"]), **FIXUPS.get(model_type, {})}
    if "qk_rope_head_dim" in fields:  # MLA expands its latent to every head: kv = heads
        fields.update({k: d["heads"] for k in ("num_key_value_heads", "num_kv_heads") if k in fields})
        if "head_dim" in fields:
            fields["head_dim"] = fields["qk_rope_head_dim"]
    cfg = tf.AutoConfig.for_model(model_type, **fields)
    if hasattr(getattr(cfg, "ffn_config", None), "hidden_size"):  # DBRX mirrors d_model into
        cfg.ffn_config.hidden_size = cfg.hidden_size  # its experts' config before the alias is set
    return cfg


def build_family(model_type: str, device: str = "cpu", d: dict | None = None, seed: int = 0):
    """The tiny (or ``d``-sized) ``model_type`` causal LM, fp32, random weights, seeded."""
    import transformers as tf

    from benchmarks.model_zoo import TINY

    cfg = tiny_config(model_type, d or TINY)
    torch.manual_seed(seed)
    with torch.device(device):
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def tiny_cluster(world: int):
    """The zoo's verification cluster: A100s on links too fast to matter, fp32, flash."""
    from cost_models.hardware import Cluster, LinkSpec

    a100 = Cluster.dgx_a100(1)
    fast = LinkSpec(name="ideal", bandwidth_gbps=1e6, latency_s=1e-12, source="model zoo")
    return Cluster(device=a100.device, gpus_per_node=world, nodes=1, intra_node=fast,
                   inter_node=fast, name="zoo", dtype="fp32", attention="flash")


def solver_pattern(model_type: str) -> str:
    """"Megatron" when the solver's tp = 2 plan of the wide ``model_type`` model on one
    DGX-A100 node follows Megatron-LM's pattern, else the first Linears that differ."""
    import autopar
    from autopar.graph.capture import trace_model
    from benchmarks.model_zoo import BATCH, WIDE, WIDE_SEQ, megatron_pattern
    from cost_models.hardware import Cluster

    model = build_family(model_type, device="meta", d=WIDE)
    plan = autopar.plan(model, Cluster.dgx_a100(1), global_batch_size=BATCH, seq_len=WIDE_SEQ,
                        layout=autopar.Layout(tp=2, pp=1, dp=4, micro_batch_size=1),
                        model_name=model_type)
    broken = megatron_pattern(trace_model(model, WIDE_SEQ), plan.placements)
    return "Megatron" if not broken else "differs: " + ", ".join(broken[:2])


def megatron_tp2(model_type: str):
    """Megatron-LM's tp = 2 layout of the tiny ``model_type`` model priced by
    ``autopar.evaluate`` (its placements, no search): sequence parallelism and selective
    recompute on, fp32, on :func:`tiny_cluster`."""
    import autopar
    from benchmarks.model_zoo import BATCH, TINY_SEQ

    layout = autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=BATCH, dtype="fp32",
                            sequence_parallel=True, recompute="selective")
    return autopar.evaluate(build_family(model_type, device="meta"), tiny_cluster(2), layout,
                            global_batch_size=BATCH, seq_len=TINY_SEQ, model_name=model_type)


def _verify_rank(rank: int, world: int, model_type: str, plan) -> dict:
    from autopar.verify.check import verify

    return verify(build_family(model_type), plan).to_dict()


def planned(model_type: str) -> str:
    """:func:`solver_pattern`, or "stopped: <typed error>" where planning stopped."""
    from benchmarks.model_zoo import _first_line

    try:
        return solver_pattern(model_type)
    except Exception as exc:  # the planning half's typed error
        return f"stopped: {type(exc).__name__}: {_first_line(exc)}"


def verify_family(model_type: str) -> tuple[str, str]:
    """(the solver's TP placements: "Megatron" or the Linears that differ, the outcome of
    verifying Megatron-LM's tp2 layout against one process: "ok (max grad diff)" or
    "stopped: <typed error>")."""
    from autopar.runtime.launch import launch
    from benchmarks.hf_families import _verify_rank  # importable by the spawned ranks
    from benchmarks.model_zoo import _first_line

    pattern = planned(model_type)
    try:
        report = launch(_verify_rank, 2, model_type, megatron_tp2(model_type), timeout_s=300,
                        pg_timeout_s=60)[0]
    except Exception as exc:  # the row records the typed error that stopped the family
        return pattern, f"stopped: {type(exc).__name__}: {_first_line(exc)}"
    noisy = any(p["grad_noise"] for p in report["params"])
    judged = ", against fp32's own rounding" if noisy else ""
    return pattern, (f"ok ({report['max_grad_diff']:.1e}{judged})" if report["ok"] else "MISMATCH")


MARKER = "## Every causal-LM family of transformers"


def earlier_rows(path) -> dict[str, tuple[str, ...]]:
    """The rows of :data:`MARKER`'s table in the report at ``path``, by family ({} when
    there is none)."""
    from pathlib import Path

    path = Path(path)
    if not path.exists() or MARKER not in path.read_text():
        return {}
    rows = {}
    for line in path.read_text().split(MARKER)[1].splitlines():
        cells = tuple(c.strip() for c in line.strip().strip("|").split("|"))
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "family":
            rows[cells[0]] = cells
    return rows


def all_families_section(groups: list[str], log=print,
                         keep: dict[str, tuple[str, ...]] | None = None,
                         run: bool = True) -> list[str]:
    """The report section of ``model_zoo.py --all``: every family of :func:`causal_lm_families`
    in ``groups`` verified by :func:`verify_family`, the others with their reason, and
    the share of each group that verifies. ``keep``: earlier rows (:func:`earlier_rows`)
    whose verification is taken as it is when it passed (``--retry``), or whatever it was
    when ``run`` is False (``--no-verify``: planned again, nothing verified); a family
    outside ``groups`` keeps its earlier row."""
    import transformers

    rows = []
    for family in causal_lm_families():
        old = (keep or {}).get(family.model_type)
        if family.group == "out of scope":
            row = (family.model_type, family.group, family.reason, "—", "not run")
        elif family.group not in groups:  # another run's row, or none
            row = (family.model_type, family.group, *old[2:]) if old else (
                family.model_type, family.group, "", "—", "not run")
        elif family.reason:  # the tiny model does not build
            row = (family.model_type, family.group, "", "—", f"stopped: {family.reason}")
        elif not run:  # planned again; the verification as the report had it
            row = (family.model_type, family.group, "", planned(family.model_type),
                   old[4] if old else "not run")
        elif old and old[4].startswith("ok"):
            row = (family.model_type, family.group, *old[2:])
        else:
            row = (family.model_type, family.group, "", *verify_family(family.model_type))
        rows.append(row)
        log(" | ".join(row))
    totals = []
    for group in ("dense", "moe", "hybrid"):
        run = [r for r in rows if r[1] == group and r[4] != "not run"]
        ok = [r for r in run if r[4].startswith("ok")]
        both = [r for r in ok if not r[3].startswith(("stopped", "—"))]
        if run:
            totals.append(f"{group}: {len(ok)} of {len(run)} verify ({100 * len(ok) / len(run):.0f}%), "
                          f"{len(both)} of them also planned by the solver")
    return [MARKER, "",
            f"`python benchmarks/model_zoo.py --all` (transformers {transformers.__version__}, "
            f"torch {torch.__version__}): every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, "
            "sorted by `benchmarks/hf_families.py` (decoder-only dense, MoE, hybrid: with "
            "recurrent, state-space or linear-attention layers; or out of scope with the reason), built from its config's defaults at the tiny size (h = 64, "
            "2 layers, s = 16, fp32; MoE: 4 experts, top-2, every layer MoE). Verify: "
            "Megatron-LM's tp2 layout (`autopar.evaluate`: column-parallel QKV and MLP-in, "
            "row-parallel outputs, vocabulary-parallel embedding, sequence parallelism, "
            "selective recompute) against one process, 3 SGD steps, max relative gradient "
            "difference. TP placements: the solver's own tp2 plan of the wide instance "
            "(h = 1024, 8×A100) against Megatron's pattern.", "",
            "**" + "; ".join(totals) + "**", "",
            "| family | group | out of scope because | TP placements (solver, wide) | verify tp2 (Megatron layout) |",
            "|---|---|---|---|---|", *("| " + " | ".join(row) + " |" for row in rows)]


def write_section(path, section: list[str]) -> None:
    """Replace :data:`MARKER`'s section (to the end) of the report at ``path`` with
    ``section``, keeping what comes before it."""
    from pathlib import Path

    path = Path(path)
    text = path.read_text() if path.exists() else "# Model zoo\n"
    head = text.split(MARKER)[0].rstrip("\n")
    path.write_text(head + "\n\n" + "\n".join(section) + "\n")
