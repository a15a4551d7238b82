"""Tiny seeded transformers experts modules and routings for the expert-parallel tests.

A plain module (no fixtures), importable by spawned gloo ranks too: every rank and the
single-process reference build the same weights and data from the same seeds. Built from
each family's Config class with random weights (no hub access).
"""

from __future__ import annotations

import torch

H, F, K = 32, 32, 2  # hidden size h, expert intermediate size, experts per token k
FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "nemotron_h")


def experts(family: str, num_experts: int, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """``family``'s stacked-experts module with E = ``num_experts``, h = H, F, seeded normal
    weights (std 0.2), in ``dtype``; its forward is transformers' eager loop."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls
        config = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=num_experts,
                               num_experts_per_tok=K)
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls
        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=num_experts,
                                num_experts_per_tok=K)
    elif family == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts as cls
        config = OlmoeConfig(hidden_size=H, intermediate_size=F, num_experts=num_experts,
                             num_experts_per_tok=K)
    elif family == "gpt_oss":  # biases, (E, in, out) weights, gate/up interleaved
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls
        config = GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=num_experts,
                              num_experts_per_tok=K)
    elif family == "nemotron_h":  # no gate: up_proj, act_fn (relu²), down_proj
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts as cls
        config = NemotronHConfig(hidden_size=H, moe_intermediate_size=F,
                                 n_routed_experts=num_experts, num_experts_per_tok=K)
    else:
        raise KeyError(family)
    config._experts_implementation = "eager"
    module = cls(config)
    g = torch.Generator().manual_seed(FAMILIES.index(family))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.to(dtype)


def routing(kind: str, rank: int, ep: int, num_experts: int, seed: int,
            dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s inputs: x (T, h), top_k_index (T, k), top_k_weights (T, k) and the
    upstream gradient dy (T, h) of loss = (y · dy).sum().

    kind "random": T = 6 + rank tokens routed by a random router (top-k of its logits,
    softmax over the k). kind "skewed" (use E = 8): every token picks 2 of experts
    {1, 2, 3} by hand, so expert 0 gets nothing and the ranks holding experts ≥ 4 (rank 1
    at ep = 2; ranks 2 and 3 at ep = 4) receive nothing; the last rank has no tokens.
    """
    g = torch.Generator().manual_seed(1000 * seed + rank)
    tokens = 6 + rank if kind == "random" else (0 if rank == ep - 1 else 5)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    if kind == "random":
        router = torch.randn(num_experts, H, generator=torch.Generator().manual_seed(seed),
                             dtype=torch.float64)
        top, index = (x @ router.T).topk(K, dim=-1)
    else:
        pairs = torch.tensor([[1, 2], [2, 3], [3, 1]])
        index = pairs[torch.arange(tokens) % 3]
        top = torch.randn(tokens, K, generator=g, dtype=torch.float64)
    return {"x": x.to(dtype), "index": index, "weights": top.softmax(-1).to(dtype),
            "dy": torch.randn(tokens, H, generator=g, dtype=torch.float64).to(dtype)}
