"""Tensors written in place after the node that makes them (``autopar.graph.aliases``).

DeepSeek-V3's multi-head latent attention fills its keys into a ``new_empty`` buffer
through two ``copy_`` into slices of it. The TP rewrite used to slice that buffer for
attention on head shards right after ``new_empty``, before the copies: the solver's tp = 2
placements of the model zoo's DeepSeek-V3 (attention on head shards, q_b_proj whole) then
read uninitialised keys (gradient norm inf; q_b_proj's gradient 1e20 relative off).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.graph.aliases import alias_root, in_place_writes, last_write_before, written_later
from autopar.graph.capture import trace_model
from autopar.planner.strategies import node_strategies
from autopar.rewrite.tensor_parallel import apply_tensor_parallel


class _KeyBuffer(nn.Module):
    """Keys built as DeepSeek-V3 builds them: a buffer, two slices of it written in place."""

    def forward(self, k_pass: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
        b, nh, s, d = k_pass.shape  # (b, nh, s, d)
        k = k_pass.new_empty(b, nh, s, 2 * d)
        k[..., :d] = k_pass
        k[..., d:] = k_rot
        return k.transpose(1, 2) * 2  # a view made after the writes, then a reader


def _graph():
    args = (torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3))
    return torch.export.export(_KeyBuffer(), args, strict=False).module().graph


def test_the_buffer_its_views_and_writers_share_the_writes():
    graph = _graph()
    buffer = next(n for n in graph.nodes if "new_empty" in str(n.target))
    copies = [n for n in graph.nodes if "copy_" in str(n.target)]
    assert len(copies) == 2
    writes = in_place_writes(graph)
    assert writes[buffer] == copies
    late = next(n for n in graph.nodes if "transpose" in str(n.target))
    assert alias_root(late) is buffer and alias_root(copies[0]) is buffer
    written = written_later(graph)
    assert {buffer.name, *(c.name for c in copies)} <= written
    assert {c.args[0].name for c in copies} <= written  # the slices written into
    assert late.name not in written  # made after the last write: final, free to reshard
    order = {n: i for i, n in enumerate(graph.nodes)}
    reader = next(iter(late.users))
    assert last_write_before(buffer, reader, writes, order) is copies[-1]
    assert last_write_before(late, reader, writes, order) is late
    assert last_write_before(buffer, copies[0], writes, order) is buffer


@pytest.fixture(scope="module")
def deepseek_v3():
    pytest.importorskip("transformers")
    from benchmarks.hf_families import build_family

    return lambda: trace_model(build_family("deepseek_v3"), 16)


def test_deepseek_v3_key_buffer_stays_whole_and_is_sliced_after_its_writes(deepseek_v3):
    """The buffer, its slices and the copies get no sharded option (a copy taken before a
    write, or written into, would be stale); attention may still run on head shards, and
    the rewrite slices the buffer for it after the second ``copy_``."""
    traced = deepseek_v3()
    options = node_strategies(traced, 2)
    for name in ("new_empty", "slice_16", "copy_", "slice_17", "copy__1"):
        assert [s.key for s in options[name]] == ["replicate:R"], name
    assert "heads:S1" in [s.key for s in options["scaled_dot_product_attention"]]

    placements = {name: opts[0].key for name, opts in options.items()}
    placements["scaled_dot_product_attention"] = "heads:S1"
    gm = apply_tensor_parallel(traced, placements, tp=2, tp_rank=1, group=None).gm
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    sdpa = next(n for n in gm.graph.nodes if n.name == "scaled_dot_product_attention")
    key = sdpa.args[1]  # the scatter of new_empty to this rank's heads
    assert key.op == "call_module" and key.args[0].name == "new_empty", gm.code
    assert order["copy__1"] < order[key.name] < order[sdpa.name], gm.code
