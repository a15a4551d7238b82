"""autopar.runtime.context_parallel: causal attention over a sequence split head-tail over
cp gloo ranks equals one process's ``F.scaled_dot_product_attention(is_causal=True)`` on the
whole sequence, output and dq/dk/dv, in float64 (cp = 2 and 4, grouped-query attention);
the bytes its all-gather moves equal the record's price."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed

B, H, H_KV, S, D = 2, 4, 2, 32, 8  # grouped-query attention: 2 query heads per kv head


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (B, H, S, D), "k": (B, H_KV, S, D), "v": (B, H_KV, S, D), "w": (B, H, S, D)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def _reference() -> dict[str, torch.Tensor]:
    d = _data()
    q, k, v = (d[n].clone().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * d["w"]).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from autopar.runtime.context_parallel import context_parallel_attention, shard_sequence
    from autopar.runtime.stats import CommMeter

    d = {n: shard_sequence(t, world, rank, dim=2) for n, t in _data().items()}
    q, k, v = (d[n].clone().requires_grad_() for n in "qkv")
    axes = {dist.group.WORLD.group_name: "cp"}
    with CommMeter(axes) as fwd:
        out = context_parallel_attention(q, k, v, None, enable_gqa=True)
    with CommMeter(axes) as bwd:
        (out * d["w"]).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad,
            "fwd": dict(fwd.bytes), "bwd": dict(bwd.bytes)}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_one_process(cp):
    from autopar.runtime.context_parallel import unshard_sequence
    from autopar.techniques.context_parallel import kv_all_gather_elems

    results = run_distributed(_worker, cp)
    ref = _reference()
    for name in ("out", "q", "k", "v"):
        got = unshard_sequence([r[name] for r in results], dim=2)
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, ref[name], rtol=0, atol=1e-12, msg=name)
    # the meter's payloads (autopar.runtime.stats.CommMeter): an all-gather counts this
    # rank's shard of the whole sequence's K and V, a reduce-scatter the whole (8 bytes each)
    whole = kv_all_gather_elems(B, S, H_KV, D) * 8
    for r in results:
        assert sum(r["fwd"].values()) == whole // cp, r["fwd"]
        assert sum(r["bwd"].values()) == whole, r["bwd"]
