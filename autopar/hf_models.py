"""Hugging Face models by name: the ``hf:CONFIG`` specs of :func:`autopar.models.load_model`.

CONFIG is resolved in this order (the first that applies wins):

1. a path to a ``config.json`` (or to a directory holding one), read from disk, never from
   the hub: ``hf:./my-llama/config.json``, ``hf:./my-llama``;
2. a preset of :data:`HF_PRESETS`, the shape of a published checkpoint
   (``hf:gpt2-xl``, ``hf:llama3-8b``);
3. a ``transformers`` architecture (``model_type``) with a causal-LM head, built with its
   config class's defaults (``hf:llama``, ``hf:mistral``, ``hf:qwen2`` ...).

A preset wins over an architecture of the same name: ``hf:gpt2`` is the 124M preset, which
is also ``GPT2Config()``'s default shape. Every config's shape is checked before a model is
built (:func:`check_config_shape`): the layer count, width, heads, vocabulary and the sizes
a config may give are positive integers and the heads divide among the key/value heads; a
``config.json`` field that is not (``"hidden_size": -32``) is named as its file wrote it.
Every model is built with random weights by ``AutoModelForCausalLM.from_config`` in fp32
(a config's stored ``dtype`` is ignored; the plan's dtype decides the compute precision),
so a 70B model is only shapes on the meta device. ``transformers`` is imported only when
an ``hf:`` spec is loaded.

Every model is trained as a causal LM: logits at position i may read tokens 0..i only. Some
families choose between bidirectional and causal attention by a config field
(:data:`CAUSAL_SWITCHES`): BERT, RoBERTa, ELECTRA ... build ``*ForCausalLM`` with
``is_decoder=False`` by default, which attends both ways, so next-token training would see
the future. Such a config gets the field's causal value (``is_decoder=True``: the family's
own decoder mode, as its ``*ForCausalLM`` asks for), and a warning on the ``autopar.hf_models``
logger says what changed; the built model's config (and so a plan's ``model_config``)
records it. A family that no field makes causal (:data:`NOT_CAUSAL`) is refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["HF_PREFIX", "HF_PRESETS", "HF_ARCHITECTURES", "CAUSAL_SWITCHES", "NOT_CAUSAL",
           "CausalSwitch", "HFSpecError", "hf_factory", "hf_config", "check_config_shape"]

HF_PREFIX = "hf:"
_LOG = logging.getLogger(__name__)

# Llama 3's published shape (Dubey et al. 2024, "The Llama 3 Herd of Models",
# arXiv:2407.21783, Table 3; meta-llama/Meta-Llama-3-{8B,70B} config.json): RoPE base
# 500,000, 8,192 positions, RMSNorm eps 1e-5, SwiGLU, V = 128,256, untied output layer.
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
               bos_token_id=128000, eos_token_id=128001)

# name -> (model_type, config fields). GPT-2: Radford et al. 2019, "Language Models are
# Unsupervised Multitask Learners", Table 2 (d_model 768/1024/1280/1600, 12/24/36/48
# layers), and the openai-community/gpt2{,-medium,-large,-xl} config.json files (n_head
# 12/16/20/25, V = 50,257, 1,024 positions, dropout 0.1, tied output layer). Parameter
# counts (tests/unit/test_hf_models.py): 124,439,808 · 354,823,168 · 774,030,080 ·
# 1,557,611,200 · 8,030,261,248 · 70,553,706,496.
HF_PRESETS: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                          n_positions=1024)),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257,
                                 n_positions=1024)),
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257,
                                n_positions=1024)),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257,
                             n_positions=1024)),
    "llama3-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, intermediate_size=14336, **_LLAMA3)),
    "llama3-70b": ("llama", dict(hidden_size=8192, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8,
                                 intermediate_size=28672, **_LLAMA3)),
    # Table 3's 405B, with the 131,072 positions of its long-context stage (section 3.4.2)
    "llama3-405b": ("llama", dict(hidden_size=16384, num_hidden_layers=126,
                                  num_attention_heads=128, num_key_value_heads=8,
                                  intermediate_size=53248,
                                  **{**_LLAMA3, "max_position_embeddings": 131072})),
}

# The families the model zoo (benchmarks/model_zoo.py) captures and plans; any other
# model_type with a causal-LM head is accepted too, these are the ones error messages list.
HF_ARCHITECTURES = ("gemma", "gpt2", "gpt_neox", "llama", "mistral", "opt", "phi3", "qwen2")


@dataclass(frozen=True, kw_only=True, slots=True)
class CausalSwitch:
    """A config field by which a model chooses bidirectional or causal attention."""

    field: str
    """the config attribute (on the config or its ``text_config``)"""
    bidirectional: object
    """the value that makes attention bidirectional: the one autopar replaces"""
    causal: object
    """the value that makes it causal: the one autopar sets"""
    read_by: str
    """who reads it (transformers 5.24's source), for the warning"""
    ignored_by: frozenset[str] = frozenset()
    """model_types whose config declares the field but whose model never reads it; left
    as they are, so their recorded config equals the user's own build of it"""


# Derived from transformers 5.24: the config fields its modeling code reads to choose the
# attention mask, found by listing every causal-LM config's fields named *causal*,
# *bidirectional* or *decoder*, reading the families a probe showed bidirectional, and
# masking_utils (`is_causal`). The probe: a 2-layer model of each family with random weights,
# two token sequences differing after position 3; the logits at positions <= 3 moved by
# 0.001 to 0.9 before the switch and by exactly 0 after it. A field is a switch for every
# family that has it, so a new family using one of these names is covered without a list.
CAUSAL_SWITCHES = (
    CausalSwitch(field="is_decoder", bidirectional=False, causal=True,
                 read_by="the causal LMs of BERT-style encoders: BERT, RoBERTa, ELECTRA, "
                         "ERNIE, BigBird, RoFormer, RemBERT, X-MOD ...; Reformer's asserts it",
                 # configs declaring is_decoder=False whose causal LM attends causally all
                 # the same (probe: 0.0): GPT-NeoX never reads it, the decoders of seq2seq
                 # families (and TrOCR) set it on their own copy of the config
                 ignored_by=frozenset({
                     "gpt_neox", "gpt_neox_japanese", "trocr", "bart", "bigbird_pegasus",
                     "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                     "plbart", "prophetnet"})),
    CausalSwitch(field="is_causal", bidirectional=False, causal=True,
                 read_by="transformers' create_causal_mask, in any family (Llama and GPT-2 "
                         "included)"),
    CausalSwitch(field="use_bidirectional_attention", bidirectional=True, causal=False,
                 read_by="the Gemma families' attention"),
    CausalSwitch(field="causal", bidirectional=False, causal=True,
                 read_by="XLM, its causal-LM mode"),
    CausalSwitch(field="attn_type", bidirectional="bi", causal="uni",
                 read_by="XLNet"),
)

# Families with a causal-LM head that no config field makes causal: the same probe of the
# model_types of transformers 5.24's MODEL_FOR_CAUSAL_LM_MAPPING, 139 of its 196 (the others
# are mostly MoE / hybrid decoder LLMs over 700M parameters at 2 layers, or need sizes of
# their own to build small).
NOT_CAUSAL = {
    "cpmant": "its model builds an attention mask in which every token sees the whole "
              "sequence (CpmAntModel._prepare_attention_mask, context all ones), whatever "
              "the config says",
}

# Model dimensions a config.json may give, under Hugging Face's names and GPT-2's, OPT's
# and BLOOM's own: each, when given (null: the architecture's default), a positive integer.
DIMENSION_KEYS = ("hidden_size", "n_embd", "n_embed", "num_attention_heads", "n_head",
                  "num_hidden_layers", "n_layer", "vocab_size", "intermediate_size", "n_inner",
                  "ffn_dim", "num_key_value_heads", "max_position_embeddings", "n_positions",
                  "head_dim")
# Checked on every built config, by these names (through its attribute_map), where the
# architecture has them and they are set (not max_position_embeddings: XLNet's default is
# -1, no limit).
CONFIG_DIMENSIONS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "intermediate_size", "num_key_value_heads", "head_dim")

INSTALL_FIX = ("pip install transformers (it does not depend on torch, so the installed "
               "torch stays; add --no-deps if your environment pins torch by other means)")


class HFSpecError(ValueError):
    """An ``hf:`` spec that names no buildable causal LM. ``cause`` and ``fix`` are kept
    apart so :func:`autopar.models.load_model` words it like every model-spec error."""

    def __init__(self, cause: str, fix: str) -> None:
        super().__init__(f"{cause}; {fix}")
        self.cause, self.fix = cause, fix


def names_fix() -> str:
    """What an ``hf:`` spec may name (the fix of an unknown name)."""
    return (f"write hf:CONFIG with CONFIG a config.json file or a directory holding one, "
            f"a preset ({', '.join(HF_PRESETS)}) or a transformers architecture with a "
            f"causal-LM head ({', '.join(HF_ARCHITECTURES)}, ...)")


def _transformers():
    """The ``transformers`` module, or HFSpecError saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise HFSpecError(f"hf: models need the transformers package ({exc})",
                          INSTALL_FIX) from None
    return transformers


def _read_config_json(path: Path):
    """The config of a local ``config.json`` (or of the one inside directory ``path``)."""
    tf = _transformers()
    file = path / "config.json" if path.is_dir() else path
    try:
        fields = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HFSpecError(f"cannot read Hugging Face config {str(file)!r} ({exc})",
                          "give the path of a config.json file, or of a directory "
                          "holding one") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type not in tf.CONFIG_MAPPING:
        raise HFSpecError(f"{str(file)!r} has model_type {model_type!r}, which transformers "
                          f"{tf.__version__} does not know",
                          "a config.json written by save_pretrained names its model_type "
                          "(e.g. \"llama\"); upgrade transformers for newer architectures")
    _check_fields(fields, repr(str(file)))
    try:
        return tf.CONFIG_MAPPING[model_type].from_dict(fields)
    except _config_errors() as exc:  # the config class's own checks, in one line
        raise HFSpecError(f"{str(file)!r} is not a valid {model_type} config: "
                          f"{' '.join(str(exc).split())}",
                          "correct the field it names in the config.json") from None


def _positive_int(value: object) -> bool:
    """A whole number >= 1 (``True`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _valid_dimension(value: object) -> bool:
    """A positive integer, or one per layer (Gemma 3n's list of MLP widths)."""
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(_positive_int(v) for v in value)
    return _positive_int(value)


def _dimension_error(source: str, field: str, value: object) -> HFSpecError:
    """``field = value`` of ``source`` is not a positive integer: the cause and the fix."""
    kind = "" if isinstance(value, int) and not isinstance(value, bool) else \
        f" (a {type(value).__name__})"
    quotes = " (a number, without quotes)" if isinstance(value, str) else ""
    shown = json.dumps(value, default=repr)
    return HFSpecError(f"{source} has {field} = {shown}{kind}, which is not a positive integer",
                       f"set {field} to a whole number of at least 1{quotes} in the config")


def _check_fields(fields: dict, source: str) -> None:
    """HFSpecError naming the first model dimension of a config.json that is not a
    positive integer (as the file spells it)."""
    for key in DIMENSION_KEYS:
        value = fields.get(key)
        if value is not None and not _valid_dimension(value):
            raise _dimension_error(source, key, value)


def _config_errors() -> tuple[type[BaseException], ...]:
    """What a transformers config class raises for a field it refuses: ValueError and
    TypeError, and huggingface_hub's strict-dataclass errors (not ValueErrors)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ValueError, TypeError
    return ValueError, TypeError, StrictDataclassError


def _dimension(config, field: str):
    """``config.<field>``; None where the config has none, or one per layer (a
    heterogeneous config refuses to read those as one value, with a RuntimeError)."""
    try:
        return getattr(config, field, None)
    except RuntimeError:
        return None


def check_config_shape(config, source: str) -> None:
    """HFSpecError when ``config`` cannot describe a model: a dimension that is set and is
    not a positive integer (:data:`CONFIG_DIMENSIONS`), or query heads that do not divide
    among the key/value heads. ``source`` names the config; fields are named as it spells
    them (GPT-2: ``n_embd``). Whether the width splits into heads is the config class's
    own check (some give ``head_dim`` apart from it)."""
    names = getattr(config, "attribute_map", {}) or {}
    shape = {field: _dimension(config, field) for field in CONFIG_DIMENSIONS}
    for field, value in shape.items():
        if value is not None and not _valid_dimension(value):
            raise _dimension_error(source, names.get(field, field), value)
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    if _positive_int(heads) and _positive_int(kv) and heads % kv:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise HFSpecError(f"{source} has {names.get('num_attention_heads', 'num_attention_heads')}"
                          f" = {heads}, not divisible by num_key_value_heads = {kv} (each "
                          "key/value head serves a group of query heads)",
                          f"choose num_key_value_heads in {divisors}")


def _looks_like_path(name: str) -> bool:
    """A path: written as one (``.json``, a separator), or a bare name of a file or of a
    directory holding config.json here (a folder merely named ``llama`` is not)."""
    path = Path(name)
    return (name.endswith(".json") or "/" in name or "\\" in name or path.is_file()
            or (path / "config.json").is_file())


def hf_config(name: str):
    """The ``transformers`` config CONFIG names (the part after ``hf:``; order in the
    module docstring), its :data:`CAUSAL_SWITCHES` set to causal attention. Raises
    HFSpecError: transformers missing, file unreadable, unknown name, a config without a
    causal-LM head, one whose family cannot attend causally (:data:`NOT_CAUSAL`), or a
    shape no model has (:func:`check_config_shape`)."""
    tf = _transformers()
    if _looks_like_path(name):
        config = _read_config_json(Path(name))
    elif name in HF_PRESETS:
        model_type, fields = HF_PRESETS[name]
        config = tf.AutoConfig.for_model(model_type, **fields)
    elif name in tf.CONFIG_MAPPING:
        config = tf.AutoConfig.for_model(name)
    else:
        raise HFSpecError(f"unknown Hugging Face model 'hf:{name}'", names_fix())
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise HFSpecError(
            f"'hf:{name}' is a {type(config).__name__} ({config.model_type}), which has no "
            "causal-LM head (AutoModelForCausalLM); autopar trains decoder language models",
            "choose a decoder architecture such as " + ", ".join(HF_ARCHITECTURES))
    check_config_shape(config, f"'hf:{name}'")
    _make_causal(config, name)
    return config


def _make_causal(config, name: str) -> None:
    """Set every :data:`CAUSAL_SWITCHES` field of ``config`` (or of its ``text_config``)
    that holds its bidirectional value to the causal one, logging each change. Raises
    HFSpecError for a family of :data:`NOT_CAUSAL`."""
    if config.model_type in NOT_CAUSAL:
        raise HFSpecError(
            f"'hf:{name}' is a {type(config).__name__} ({config.model_type}), whose causal-LM "
            f"head does not attend causally: {NOT_CAUSAL[config.model_type]}; trained on next "
            "tokens it would see the future",
            "choose a decoder architecture such as " + ", ".join(HF_ARCHITECTURES))
    for part in (config, getattr(config, "text_config", None)):
        for switch in CAUSAL_SWITCHES:
            if part is not None and _bidirectional(part, switch):
                setattr(part, switch.field, switch.causal)
                _LOG.warning("hf:%s: %s.%s=%r attends bidirectionally (the field is read by "
                             "%s); set to %r, the family's causal mode, so it trains as a "
                             "causal LM", name, type(part).__name__, switch.field,
                             switch.bidirectional, switch.read_by, switch.causal)


def _bidirectional(config, switch: CausalSwitch) -> bool:
    """Whether ``config`` holds ``switch``'s bidirectional value (of the same type: Gemma's
    ``use_bidirectional_attention="vision"``, bidirectional among image tokens only, is no
    ``True``)."""
    value = getattr(config, switch.field, None)
    return (getattr(config, "model_type", None) not in switch.ignored_by
            and type(value) is type(switch.bidirectional) and value == switch.bidirectional)


def hf_factory(name: str) -> Callable[[], nn.Module]:
    """A function of no arguments building CONFIG's causal LM with random fp32 weights
    (call it under ``torch.device(...)``). The config is resolved now, so a bad name fails
    before anything is built."""
    config = hf_config(name)

    def build() -> nn.Module:
        return _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return build
