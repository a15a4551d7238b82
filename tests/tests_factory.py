"""A user's model factory, as `autopar plan --model tests_factory:tiny_gpt` would load it."""

from autopar.models import GPT, GPTConfig


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))
