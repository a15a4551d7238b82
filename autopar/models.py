"""The reference GPT: a plain, single-device, nanoGPT-style decoder.

autopar plans and rewrites this model like any user model; nothing in it knows about
parallelism. Two choices keep it friendly to graph-level tensor parallelism, and are
worth copying into a user's model:

* Q, K and V are three ``nn.Linear`` layers (as in Llama / GPT-NeoX-style code), so a
  column split of each gives whole heads per rank without re-ordering a fused weight.
* Reshapes infer the head count (``view(b, s, -1, head_dim)``, ``reshape(b, s, -1)``), so
  the same code runs on ``n_head / tp`` local heads.

Module names follow nanoGPT / GPT-2 (``transformer.wte``, ``transformer.h.0.attn.c_proj``,
``transformer.h.0.mlp.c_fc`` ...). ``lm_head`` shares its weight with ``transformer.wte``.

:func:`load_model` is the one way a model is named outside Python code (the CLI's
``--model``, a saved plan's ``model``): a preset of :data:`PRESETS`, ``module:factory`` or
``hf:CONFIG`` (a Hugging Face model from a config: :mod:`autopar.hf_models`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.hf_models import HF_PREFIX, HFSpecError, hf_factory, names_fix

__all__ = ["GPTConfig", "GPT", "gpt2_init", "PRESETS", "preset", "load_model", "model_config",
           "default_seq_len", "pad_vocab_size"]


def pad_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple`` (Megatron pads V to 128·t)."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT.

    n_layer: number of transformer layers L.
    n_head: attention heads a.
    n_embd: hidden size h (must be divisible by n_head).
    vocab_size: vocabulary V (already padded if the caller wants padding).
    block_size: maximum sequence length s (learned position embeddings).
    dropout: dropout probability in attention output, MLP output and embeddings.
    """

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for field in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def num_params(self) -> int:
        """Parameter count Ψ (tied lm_head counted once), from the module definitions below."""
        h, L, V, s = self.n_embd, self.n_layer, self.vocab_size, self.block_size
        per_layer = 12 * h * h + 13 * h  # qkv+proj (4h²+4h), mlp (8h²+5h), 2 LayerNorms (4h)
        return L * per_layer + V * h + s * h + 2 * h

    def to_dict(self) -> dict:
        return asdict(self)


# Named presets. Sizes follow Brown et al. 2020 (GPT-3, Table 2.1) and Narayanan et al.
# 2021 (Table 1); V = 51200 is GPT-2's 50257 padded the way Megatron pads it (to 1024 = 128·8).
# The large models use Megatron-LM's default hidden/attention dropout of 0.1, which the
# activation-memory accounting of Korthikanti et al. 2022 assumes.
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16),
    "gpt-small-test": GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=64),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024),
    "gpt-1.3b": GPTConfig(n_layer=24, n_head=32, n_embd=2048, vocab_size=51200, block_size=2048, dropout=0.1),
    "gpt-8.3b": GPTConfig(n_layer=72, n_head=32, n_embd=3072, vocab_size=51200, block_size=1024, dropout=0.1),
    "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, vocab_size=51200, block_size=2048, dropout=0.1),
    "gpt-1t": GPTConfig(n_layer=128, n_head=160, n_embd=25600, vocab_size=51200, block_size=2048, dropout=0.1),
}


def _model_spec_error(cause: str, fix: str | None = None) -> ValueError:
    """The one error for a model name that cannot be loaded: the cause, then the fix (by
    default, every kind of spec there is)."""
    if fix is None:
        fix = (f"name a preset ({', '.join(sorted(PRESETS))}), 'module:factory', a function "
               "returning an nn.Module, whose module is imported from the current directory "
               "or sys.path (e.g. mypkg.models:build_gpt), or a Hugging Face model: "
               + names_fix())
    return ValueError(f"{cause}; {fix}")


def preset(name: str) -> GPTConfig:
    """Return the named preset config; ValueError lists the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise _model_spec_error(f"unknown model preset {name!r}") from None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_embd)
        self.c_k = nn.Linear(config.n_embd, config.n_embd)
        self.c_v = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        # (b, s, h) -> (b, nh, s, hd); nh inferred so a head-split shard runs unchanged
        q = self.c_q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, s, nh*hd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def gpt2_init(name: str, module: nn.Module, n_layer: int, std: float = 0.02) -> None:
    """GPT-2's initialisation of one module, in place (Radford et al. 2019, as nanoGPT and
    :class:`GPT` do it): Linear and Embedding weights N(0, std²), biases 0, an embedding's
    padding row 0; the residual projections (modules named ``…c_proj``) N(0, (std/√(2·L))²)
    for L = ``n_layer``; other modules their own ``reset_parameters()`` (LayerNorm: 1, 0).

    An ``init_fn(name, module)`` for :func:`autopar.init_model` / ``autopar.parallelize``
    of a meta model: ``functools.partial(gpt2_init, n_layer=L)`` fits a nanoGPT-style model.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        scaled = isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] == "c_proj"
        nn.init.normal_(module.weight, mean=0.0, std=std / math.sqrt(2 * n_layer) if scaled else std)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


class GPT(nn.Module):
    """GPT decoder. ``forward(idx (b, s) int64, targets (b, s) | None) -> (logits (b, s, V), loss | None)``.

    loss is the mean token cross-entropy. Build on the meta device to plan a large model
    without allocating it: ``with torch.device("meta"): GPT(preset("gpt3-175b"))``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):  # GPT-2 scaled init of residual projections
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def init_module(self, name: str, module: nn.Module) -> None:
        """The init rule of one module (``name``: its qualified name), for
        :func:`autopar.init_model` and a parallelized meta model: :func:`gpt2_init` with
        this model's depth (the distributions ``__init__`` draws from)."""
        gpt2_init(name, module, self.config.n_layer)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        s = idx.size(1)
        pos = torch.arange(0, s, dtype=torch.long, device=idx.device)  # (s,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (b, s, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def load_model(spec: str, *, device: str | torch.device | None = "meta",
               seed: int | None = None) -> tuple[nn.Module, str]:
    """Build the model named by ``spec``; returns ``(model, spec)``.

    spec: a preset name (:data:`PRESETS`, built as :class:`GPT`); ``hf:CONFIG``, a Hugging
        Face causal LM with random weights from a ``config.json`` path, a published shape
        (``hf:gpt2`` ... ``hf:gpt2-xl``, ``hf:llama3-8b``, ``hf:llama3-70b``) or an
        architecture's default config (``hf:llama``; :mod:`autopar.hf_models`); or
        ``module:factory``, a function of no arguments returning an ``nn.Module``. The
        module is imported from ``sys.path`` with the current directory on it (as ``python
        -m`` does; the ``autopar`` console script starts elsewhere), so ``--model
        mypkg.models:build_gpt`` works from the directory holding ``mypkg`` (a module
        named ``hf`` cannot be named this way: ``hf:`` is read as a Hugging Face spec).
    device: where parameters are created: ``"meta"`` (default) gives shapes only, for
        planning a model of any size without allocating it; ``"cpu"`` materialises it (as
        ``autopar verify`` does); None uses torch's current default device.
    seed: ``torch.manual_seed(seed)`` before building, so every process that builds the
        same spec with the same seed holds the same initial weights.
    Raises ValueError naming the cause (unknown preset, module or factory not importable,
    transformers not installed, a config without a causal-LM head or of a family that
    cannot attend causally, a config dimension that is not a positive integer, e.g.
    ``"hidden_size": -32``, naming the field) and the fix.
    """
    if spec.startswith(HF_PREFIX):
        try:
            build = hf_factory(spec[len(HF_PREFIX):])
        except HFSpecError as exc:
            raise _model_spec_error(exc.cause, exc.fix) from None
    elif ":" in spec:
        build = _import_factory(spec)
    elif spec in PRESETS:
        def build() -> nn.Module:
            return GPT(PRESETS[spec])
    else:
        raise _model_spec_error(f"unknown model {spec!r}")
    if seed is not None:
        torch.manual_seed(seed)
    if device is None:
        return build(), spec
    with torch.device(device):
        return build(), spec


def _import_factory(spec: str):
    """The function named by ``module:factory`` (the current directory on sys.path)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, _, factory = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), factory)
    except (ImportError, AttributeError) as exc:
        raise _model_spec_error(f"cannot load model factory {spec!r} ({exc})") from exc


def default_seq_len(model: nn.Module) -> int | None:
    """The longest sequence the model's config allows: ``block_size`` (GPT, nanoGPT),
    ``n_positions`` (Hugging Face GPT-2) or ``max_position_embeddings`` (Llama and most
    Hugging Face families); None when the model has no config naming one."""
    cfg = getattr(model, "config", None)
    for field in ("block_size", "n_positions", "max_position_embeddings"):
        value = getattr(cfg, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# Hugging Face config fields that are provenance or storage, not shape: a model loaded
# with AutoConfig.from_pretrained(dir) matches a plan of ``hf:dir``.
NOT_SHAPE = ("transformers_version", "_name_or_path", "dtype", "torch_dtype")


def model_config(model: nn.Module) -> dict:
    """The model's shape as a plain dict (``model.config.to_dict()``: a :class:`GPTConfig`
    or a Hugging Face config), or ``{}`` when it has none. Recorded in a Plan
    (``Plan.model_config``) so a plan applied to another model is refused.

    The dict is what it reads back as from the plan's JSON (a Hugging Face ``id2label``
    has int keys, which JSON turns into strings), so a saved plan matches its model.
    Fields that say where a config came from or how its weights are stored
    (:data:`NOT_SHAPE`) are left out: the plan's dtype decides the precision."""
    cfg = getattr(model, "config", None)
    if not hasattr(cfg, "to_dict"):
        return {}
    fields = {k: v for k, v in cfg.to_dict().items() if k not in NOT_SHAPE}
    return json.loads(json.dumps(fields, default=str))
