"""The TP rewrite at t = 8 without processes: rank 3's program of a tiny GPT.

Megatron's placements (``megatron_placements``) rewritten by ``apply_tensor_parallel`` with
``group=None`` and torch.distributed not initialised (the operators are then one-rank
no-ops; the rewrite itself reads only ``tp`` and ``tp_rank``). Checked: the collectives per
layer (Megatron's f before each column-parallel block and g after each row-parallel one,
Shoeybi et al. 2019, fig. 3), the vocab-parallel embedding's all-reduce and the head's f,
the local parameter shapes, and the generated code of layer 0 against a golden file
(tests/unit/golden/tp8_layer.txt; regenerate with AUTOPAR_UPDATE_GOLDEN=1 after an intended
change of the rewrite, and review the diff).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from autopar.graph.capture import trace_model
from autopar.models import GPT, GPTConfig
from autopar.planner.strategies.megatron import megatron_placements
from autopar.rewrite.tensor_parallel import apply_tensor_parallel

TP, RANK, SEQ = 8, 3, 16
CONFIG = GPTConfig(n_layer=2, n_head=8, n_embd=64, vocab_size=128, block_size=SEQ)
COLLECTIVES = ("CopyToTPRegion", "ReduceFromTPRegion", "GatherFromTPRegion", "ScatterToTPRegion",
               "ReduceScatterToTPRegion", "GatherToTPRegionWithPartialGrad")


@pytest.fixture(scope="module")
def rewritten():
    torch.manual_seed(0)
    traced = trace_model(GPT(CONFIG), SEQ)
    placements = megatron_placements(traced, TP)
    apply_tensor_parallel(traced, placements, tp=TP, tp_rank=RANK, group=None)
    return traced.gm


def _layer_of(name: str) -> int | None:
    for layer in range(CONFIG.n_layer):
        if name.startswith(f"transformer_h_{layer}_"):
            return layer
    return None


def _regions(gm) -> list[list[torch.fx.Node]]:
    """The graph cut at the first node of each layer: [before layer 0, layer 0, ..., after]."""
    regions: list[list[torch.fx.Node]] = [[]]
    for node in gm.graph.nodes:
        layer = _layer_of(node.name)
        if layer is not None and layer == len(regions) - 1:
            regions.append([])
        regions[-1].append(node)
    return regions


def _collectives(gm, nodes) -> Counter:
    kinds = (type(gm.get_submodule(n.target)).__name__ for n in nodes if n.op == "call_module")
    return Counter(k for k in kinds if k in COLLECTIVES)


def test_megatron_collectives_per_layer(rewritten):
    regions = _regions(rewritten)
    assert len(regions) == CONFIG.n_layer + 1
    embedding, *layers = regions
    assert _collectives(rewritten, embedding) == {"ReduceFromTPRegion": 1}  # vocab-parallel embedding's g
    for layer, nodes in enumerate(layers[:-1]):
        # attention and MLP: f (copy forward, all-reduce backward) in, g (all-reduce) out
        assert _collectives(rewritten, nodes) == {"CopyToTPRegion": 2, "ReduceFromTPRegion": 2}, layer
    # the last region: layer L-1 and then the head, whose input passes through one more f
    assert _collectives(rewritten, layers[-1]) == {"CopyToTPRegion": 3, "ReduceFromTPRegion": 2}
    total = _collectives(rewritten, list(rewritten.graph.nodes))
    assert total == {"CopyToTPRegion": 2 * CONFIG.n_layer + 1, "ReduceFromTPRegion": 2 * CONFIG.n_layer + 1}


def test_local_parameter_shapes(rewritten):
    h, v, t = CONFIG.n_embd, CONFIG.vocab_size, TP
    modules = dict(rewritten.named_modules())
    for layer in range(CONFIG.n_layer):
        column = {f"attn_c_{x}": (h, h) for x in "qkv"} | {"mlp_c_fc": (h, 4 * h)}
        for name, (fan_in, fan_out) in column.items():  # column parallel: out_features / t
            linear = modules[f"transformer_h_{layer}_{name}_tp"]
            assert (linear.in_features, linear.out_features) == (fan_in, fan_out // t), name
            assert linear.bias.shape == (fan_out // t,), name
        for name, fan_in in {"attn_c_proj": h, "mlp_c_proj": 4 * h}.items():  # row parallel
            linear = modules[f"transformer_h_{layer}_{name}_tp"]
            assert (linear.in_features, linear.out_features) == (fan_in // t, h), name
            assert linear.bias is None, name  # the bias is added once, after g
    params = dict(rewritten.named_parameters())
    assert params["transformer_wte_tp.weight"].shape == (v // t, h)  # vocab-parallel rows
    assert modules["lm_head_tp"].weight is params["transformer_wte_tp.weight"]  # tied, V/t rows
    assert params["transformer.wpe.weight"].shape == (SEQ, h)  # replicated
    assert sum(p.numel() for n, p in params.items() if n.endswith("_tp.weight")) * t == sum(
        p.numel() for n, p in GPT(CONFIG).named_parameters()
        if n.endswith(("c_q.weight", "c_k.weight", "c_v.weight", "c_proj.weight", "c_fc.weight",
                       "wte.weight")))


def test_layer_code_matches_golden(rewritten, golden):
    """The generated code of layer 0: from its first node to the first node of layer 1."""
    lines = rewritten.code.splitlines()
    start = next(i for i, line in enumerate(lines) if "transformer_h_0_" in line)
    end = next(i for i, line in enumerate(lines) if "transformer_h_1_" in line)
    golden("tp8_layer.txt", "\n".join(line.strip() for line in lines[start:end]) + "\n")
