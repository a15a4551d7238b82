"""Model definitions written the way two other training stacks write theirs (issue 32).

Neither stack is imported (litgpt pulls in Lightning; torchtitan is not on every torch the
tests run on); each class keeps what matters to autopar from its original, with the file
it follows named:

* :class:`LitStyleGPT`, after litgpt 0.5 ``litgpt/model.py`` ``GPT``: the rotary ``cos`` and
  ``sin`` caches are non-persistent buffers the constructor computes (through the
  ``max_seq_length`` setter), sliced to the sequence in the model's forward and handed to
  every block; ``reset_parameters()`` recomputes them; ``_init_weights(module)`` is the
  parameter rule (normal 0.02, zero biases).
* :class:`TitanStyleLlama`, after torchtitan 0.2.2 ``models/llama3/model/model.py``
  ``Transformer``: one complex ``freqs_cis`` table, a non-persistent buffer on the model
  computed by the constructor, handed whole to every layer, which slices it; layers in an
  ``nn.ModuleDict`` keyed "0", "1", ...; ``init_weights(buffer_device)`` recomputes the
  table (torchtitan calls it after ``to_empty``).

* :class:`LoopedLM`, after Hugging Face's Dory (``models/dory/modeling_dory.py``) and other
  looped-depth models: the same layers run twice, so each Linear is called twice; its
  forward branches on the sequence length, so ``torch.export`` captures it, not
  ``symbolic_trace``, and draws random numbers in training (input jitter).

* :class:`FunctionLM`: each layer's output through the model's own
  ``torch.autograd.Function`` (:class:`ScaledStraightThrough`, a backward that is not the
  derivative of its forward), as PhiMoE's router and Bloom's GELU are written.

All are causal LMs with ``forward(idx (b, s)) -> logits (b, s, V)``. Built under
``torch.device("meta")`` their buffers are on meta too: only the stacks' own hooks can
compute them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["StackConfig", "LitStyleGPT", "TitanStyleLlama", "LoopedLM", "FunctionLM",
           "ScaledStraightThrough"]


@dataclass(frozen=True)
class StackConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    vocab_size: int = 128
    block_size: int = 32
    rope_base: float = 10000.0


# ----------------------------------------------------------------- litgpt's GPT layout
class _LitAttention(nn.Module):
    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.n_head, self.head_size = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.n_head, self.head_size).transpose(1, 2) for t in (q, k, v))
        q, k = _lit_rope(q, cos, sin), _lit_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


def _lit_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """litgpt's ``apply_rope``: rotate halves, x * cos + rotated * sin."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _LitBlock(nn.Module):
    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = _LitAttention(cfg)
        self.norm_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class LitStyleGPT(nn.Module):
    """litgpt's ``GPT`` (module docstring)."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.config = cfg
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            h=nn.ModuleList(_LitBlock(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.max_seq_length = cfg.block_size

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self._max_seq_length = value
        if not hasattr(self, "cos"):  # first call: the constructor
            cos, sin = self.rope_cache()
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        elif value != self.cos.size(0):
            self.cos, self.sin = self.rope_cache(device=self.cos.device)

    def rope_cache(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (block_size, head_size): litgpt's ``build_rope_cache``."""
        head = self.config.n_embd // self.config.n_head
        theta = 1.0 / (self.config.rope_base ** (torch.arange(0, head, 2, device=device).float() / head))
        idx_theta = torch.outer(torch.arange(self.config.block_size, device=device).float(), theta)
        idx_theta = idx_theta.repeat(1, 2)
        return torch.cos(idx_theta), torch.sin(idx_theta)

    def reset_parameters(self) -> None:
        # litgpt: "Trigger resetting the rope-cache"
        self.cos, self.sin = self.rope_cache(device=self.cos.device)

    def _init_weights(self, module: nn.Module) -> None:
        """Meant to be used with ``gpt.apply(gpt._init_weights)`` (litgpt)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.size(1)
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


# --------------------------------------------------------- torchtitan's llama3 layout
def _precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    """torchtitan's ``precompute_freqs_cis``: (end, dim // 2) complex64."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def _apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan's ``apply_rotary_emb`` on (b, s, heads, head_dim) with the table sliced to
    s and broadcast (``reshape_for_broadcast``)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[0:xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class _TitanAttention(nn.Module):
    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        xk = self.wk(x).view(b, s, self.n_heads, self.head_dim)
        xv = self.wv(x).view(b, s, self.n_heads, self.head_dim)
        xq, xk = _apply_rotary_emb(xq, xk, freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                             xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class _TitanFeedForward(nn.Module):
    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        hidden = 4 * cfg.n_embd * 2 // 3
        self.w1 = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.w3 = nn.Linear(cfg.n_embd, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _TitanBlock(nn.Module):
    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.n_embd, eps=1e-5)
        self.attention = _TitanAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.n_embd, eps=1e-5)
        self.feed_forward = _TitanFeedForward(cfg)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanStyleLlama(nn.Module):
    """torchtitan's llama3 ``Transformer`` (module docstring)."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(cfg) for i in range(cfg.n_layer)})
        self.norm = nn.RMSNorm(cfg.n_embd, eps=1e-5)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        cfg = self.config
        # torchtitan: "Need to compute until at least the max token limit for generation"
        return _precompute_freqs_cis(cfg.n_embd // cfg.n_head, cfg.block_size * 2, cfg.rope_base)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's ``Transformer.init_weights``: the table on ``buffer_device``, then
        each parameter."""
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    nn.init.trunc_normal_(module.weight, mean=0.0, std=0.02)
                elif isinstance(module, nn.RMSNorm):
                    module.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.config.n_embd ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class LoopedLM(nn.Module):
    """Looped depth (module docstring): ``loops`` passes through the same titan-style
    layers; the branch on ``tokens.size(1)`` stops ``symbolic_trace``."""

    def __init__(self, cfg: StackConfig, loops: int = 2) -> None:
        super().__init__()
        self.config, self.loops = cfg, loops
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.register_buffer("freqs_cis", _precompute_freqs_cis(
            cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_base), persistent=False)
        self.layers = nn.ModuleList(_TitanBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=1e-5)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if tokens.size(1) > 1:  # a Python branch on a size: export follows it, fx cannot
            h = h * 1.0
        if self.training:  # input jitter, as PhiMoE's and Mixtral's routers draw in training
            h = h * torch.empty_like(h).uniform_(0.99, 1.01)
        for _ in range(self.loops):
            for layer in self.layers:
                h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class ScaledStraightThrough(torch.autograd.Function):
    """x · k forward, a gradient of 100 · g (not k · g) backward."""

    @staticmethod
    def forward(ctx, x, k):
        return x * k

    @staticmethod
    def backward(ctx, grad):
        return grad * 100, None


class FunctionLM(nn.Module):
    """Two Linear layers, each through :class:`ScaledStraightThrough` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, idx):
        x = self.emb(idx) * (1.0 if idx.size(1) > 1 else 2.0)  # export, not symbolic_trace
        for layer in self.layers:
            x = ScaledStraightThrough.apply(layer(x), 2.0)
        return self.head(x)
