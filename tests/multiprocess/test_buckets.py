"""Bucketed DP reduction overlapped with backward (ZeRO-0/1/2), against one process.

A 3-layer MLP (1208 parameters) over d = 3 gloo ranks, with buckets of a few hundred
bytes so that the buffer splits into several buckets, some cuts fall inside a weight and
the buffer is padded (1208 is not a multiple of 3); one weight is ``deferred`` (reduced
after backward, as the tied embedding and SP partial gradients are). Three AdamW steps of
m = 2 micro-batches under each ZeRO stage must equal one process training the whole
batch: parameters, the global gradient norm, the averaged gradient ``verify`` reads, and
the optimizer states read back (and written back) through the checkpoint adapter, while
the optimizer steps each owned shard in pieces of 37 elements. Every bucket but the
deferred one must have started its collective during backward.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.shard_state import FlatState
from autopar.runtime.zero import DistributedOptimizer
from dist_utils import run_distributed

WORLD, MICRO, ROWS, STEPS = 3, 2, 2, 3  # d, micro-batches, rows per micro-batch, steps
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 8))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n = WORLD * MICRO * ROWS
    return [(torch.randn(n, 16, generator=gen), torch.randn(n, 8, generator=gen))
            for _ in range(STEPS)]


def _reference() -> dict:
    model = _mlp()
    opt = ADAMW(model.parameters())
    norms = []
    for x, y in _batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms,
            "grads": grads, "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()]}


def _rank(rank: int, world: int) -> dict:
    out = {}
    for zero in (0, 1, 2):
        model = _mlp()
        params = list(model.parameters())
        opt = DistributedOptimizer(params, ADAMW, dp_group=dist.group.WORLD, zero_stage=zero,
                                   accumulations=MICRO, deferred=[model[2].weight],
                                   bucket_bytes=1200, first_bucket_bytes=400, piece_numel=37)
        counted, norms = {id(p) for p in params}, []
        for x, y in _batches():
            opt.zero_grad()
            rows = slice(rank * MICRO * ROWS, (rank + 1) * MICRO * ROWS)
            for xm, ym in zip(x[rows].split(ROWS), y[rows].split(ROWS)):
                (nn.functional.mse_loss(model(xm), ym) / MICRO).backward()
                opt.micro_batch_done()
            opt.reduce_gradients()
            square = opt.grad_square_sum(counted)
            dist.all_reduce(square)
            norms.append(square.sqrt().item())
            opt.step()
        opt.synchronize_gradients()
        adapter = FlatState(opt)
        exp_avg = [adapter.states(p, owner=0).get("exp_avg") for p in params]
        whole = {}  # every rank gets the whole states (reading is collective, one owner)
        for owner in range(world):
            read = {str(i): adapter.states(p, owner=owner) for i, p in enumerate(params)}
            whole = read if owner == rank else whole
        adapter.write_states({n: s for n, s in whole.items() if s}, dict(zip(whole, params)))
        again = [adapter.states(p, owner=0).get("exp_avg") for p in params]
        out[zero] = {"params": [p.detach().clone() for p in params], "norms": norms,
                     "grads": [p.grad.clone() for p in params], "exp_avg": exp_avg,
                     "exp_avg_again": again, "overlapped": opt.overlapped_buckets(),
                     "padded": opt.padded_numel, "shards": opt.shards,
                     "pieces": [[p.numel() for p in ps] for ps in opt.pieces]}
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    return _reference(), run_distributed(_rank, WORLD)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.isfinite(a).all()) and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_bucketed_steps_equal_one_process(runs, zero: int) -> None:
    ref, ranks = runs
    for result in ranks:
        got = result[zero]
        assert all(_close(a, b) for a, b in zip(got["params"], ref["params"]))
        assert all(_close(a, b) for a, b in zip(got["grads"], ref["grads"]))
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    exp_avg = ranks[0][zero]["exp_avg"]
    assert all(_close(a, b) for a, b in zip(exp_avg, ref["exp_avg"]))
    assert all(_close(a, b) for a, b in zip(ranks[0][zero]["exp_avg_again"], ref["exp_avg"]))
    for result in ranks:  # the optimizer stepped pieces, which tile each owned shard
        assert [sum(p) for p in result[zero]["pieces"]] == [hi - lo for lo, hi in result[zero]["shards"]]
        assert max(len(p) for p in result[zero]["pieces"]) > 1 and max(max(result[zero]["pieces"])) == 37


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_buckets_start_during_backward(runs, zero: int) -> None:
    """Every bucket except the deferred one (ZeRO-1/2) started in backward; the owned
    shards of the ranks tile the padded buffer."""
    _, ranks = runs
    started, buckets = ranks[0][zero]["overlapped"]
    assert buckets >= 3
    assert started == buckets - (1 if zero else 0)
    if zero:
        shards = sorted(s for r in ranks for s in r[zero]["shards"])
        padded = ranks[0][zero]["padded"]
        assert padded == 1209 and shards[0][0] == 0 and shards[-1][1] == padded
        assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
