"""A user's model factory, as `autopar plan --model tests_factory:tiny_gpt` would load it."""

import torch
import torch.nn as nn

from autopar.models import GPT, Block, GPTConfig


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))


class CumsumBlock(Block):
    """A GPT block that adds the running sum over the sequence to the residual stream:
    ``torch.cumsum``, an op no tensor-parallel strategy splits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (b, s, h)
        x = super().forward(x)
        return x + torch.cumsum(x, dim=1)


def cumsum_gpt() -> GPT:
    """``tiny_gpt`` with a :class:`CumsumBlock` per layer (s = 8, h = 16)."""
    model = tiny_gpt()
    model.transformer.h = nn.ModuleList([CumsumBlock(model.config)
                                         for _ in range(model.config.n_layer)])
    return model
