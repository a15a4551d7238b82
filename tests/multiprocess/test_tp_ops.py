"""autopar.runtime.tp_ops / tp_modules: each TP operator's forward and backward against
dense math at t = 2 (one spawn), the collectives each direction issues against the kinds
the module declares, and the t = 1 shortcut (in process)."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime import tp_ops
from autopar.runtime.mesh import ParallelGroups
from autopar.runtime.stats import CommMeter
from autopar.runtime.tp_modules import TP_OPERATORS
from dist_utils import run_distributed

T, SHAPE = 2, (2, 4, 6)  # (b, s, h), s and h divisible by T


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(T, *SHAPE, generator=g) for k in ("x", "w")}  # per-rank slot first


def _case(name: str, r: int, d: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input on rank r, the weight w of loss = (y * w).sum(), expected y, expected dx)."""
    x, w = d["x"], d["w"]
    full, weight = x[0], w[0]  # replicated tensors: the same on every rank
    if name == "copy_to_tp_region":  # y = x; each rank's columns see a part of dL/dx
        return full, w[r], full, w.sum(0)
    if name == "reduce_from_tp_region":  # y = sum_r x_r
        return x[r], weight, x.sum(0), weight
    if name == "gather_from_tp_region":  # dim 1: y = [x_0, x_1]
        return full.chunk(T, 1)[r], weight, full, weight.chunk(T, 1)[r]
    if name == "scatter_to_tp_region":  # dim -1: y = x[..., my slice]
        return full, weight.chunk(T, -1)[r], full.chunk(T, -1)[r], weight
    if name == "reduce_scatter_to_tp_region":  # dim 1: y = (sum_r x_r)[:, my slice]
        return x[r], weight.chunk(T, 1)[r], x.sum(0).chunk(T, 1)[r], weight
    if name == "gather_to_tp_region_with_partial_grad":  # dim 1: dx = (sum_r w_r)[:, my slice]
        return full.chunk(T, 1)[r], w[r], full, w.sum(0).chunk(T, 1)[r]
    raise KeyError(name)


DIMS = {"gather_from_tp_region": 1, "scatter_to_tp_region": -1,
        "reduce_scatter_to_tp_region": 1, "gather_to_tp_region_with_partial_grad": 1}


def _worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(tp=T, pp=1, dp=1)
    d, out = _data(), {}
    for cls in TP_OPERATORS:
        x, w, _, _ = _case(cls.name, groups.tp_rank, d)
        x = x.clone().requires_grad_()
        op = cls(groups.tp_group, DIMS.get(cls.name))
        with CommMeter(groups.axis_names()) as fwd:
            y = op(x)
        with CommMeter(groups.axis_names()) as bwd:
            (y * w).sum().backward()
        out[cls.name] = {"y": y.detach(), "dx": x.grad, "repr": repr(op),
                         "fwd": {k: v for k, v in fwd.bytes.items() if v},
                         "bwd": {k: v for k, v in bwd.bytes.items() if v}}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, T)


@pytest.mark.parametrize("cls", TP_OPERATORS, ids=lambda c: c.name)
def test_operator_matches_dense_math(cls, results):
    d = _data()
    for rank, res in enumerate(r[cls.name] for r in results):
        _, _, want_y, want_dx = _case(cls.name, rank, d)
        torch.testing.assert_close(res["y"], want_y)
        torch.testing.assert_close(res["dx"], want_dx)
        assert f"{cls.name}, tp={T}" in res["repr"]


@pytest.mark.parametrize("cls", TP_OPERATORS, ids=lambda c: c.name)
def test_operator_communicates_what_it_declares(cls, results):
    for res in (r[cls.name] for r in results):
        assert set(res["fwd"]) == ({cls.forward_comm} - {None}), res["fwd"]
        assert set(res["bwd"]) == ({cls.backward_comm} - {None}), res["bwd"]


@pytest.mark.parametrize("name", [cls.name for cls in TP_OPERATORS])
def test_one_rank_is_the_identity_both_ways(name):
    x = torch.randn(*SHAPE, requires_grad=True)
    fn = getattr(tp_ops, name)
    y = fn(x, None, 1) if name in DIMS else fn(x, None)  # no process group: t = 1
    assert y is x


def test_operator_names_derive_from_their_function():
    for cls in TP_OPERATORS:
        assert cls.op is getattr(tp_ops, cls.name)
        assert cls.__name__.lower() == cls.name.replace("_", "")
    with pytest.raises(TypeError, match="takes a tensor dim"):
        TP_OPERATORS[2](None)
