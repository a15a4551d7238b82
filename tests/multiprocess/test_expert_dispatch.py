"""autopar.runtime.expert_parallel at ep = 2 and ep = 4 on gloo: ExpertParallelExperts against
the single-process transformers experts module, and the all-to-all bytes of a step against
dispatch_bytes.

One launch per world size runs every case on each rank (the world is the EP group, the
process group's timeout is dist_utils.PG_TIMEOUT_S). The reference runs the original module
(transformers' eager loop) on every rank's tokens at once in this process: its output and
input gradients are split back per rank, and a local expert's weight gradient must equal
the reference's gradient of the global slice that expert came from (the sum over every
rank's tokens routed to it). float64 cases run the per-expert matmul loop, float32 ones
``grouped_mm``.
"""

from __future__ import annotations

import functools
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.compat import TorchDispatchMode, op_schema
from autopar.runtime.expert_parallel import ExpertParallelExperts, dispatch_bytes
from autopar.runtime.stats import CommMeter
from dist_utils import PG_TIMEOUT_S, run_distributed
from expert_builders import H, experts, routing

CASES = (  # (family, dtype, routing kind)
    ("mixtral", torch.float64, "random"),
    ("qwen3_moe", torch.float64, "random"),
    ("olmoe", torch.float64, "random"),
    ("gpt_oss", torch.float64, "random"),  # biases, transposed weights, interleaved gate/up
    ("nemotron_h", torch.float64, "random"),  # no gate: up_proj, relu², down_proj
    ("mixtral", torch.float64, "skewed"),  # an empty expert, ranks receiving nothing, T = 0
    ("gpt_oss", torch.float64, "skewed"),
    ("mixtral", torch.float32, "random"),  # grouped_mm
    ("mixtral", torch.float32, "skewed"),  # grouped_mm with empty groups and no rows
    ("gpt_oss", torch.float32, "random"),  # grouped_mm with biases
)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}  # max abs error, values O(1)
EPS = (2, 4)


def _num_experts(ep: int, kind: str) -> int:
    return 8 if kind == "skewed" or ep == 4 else 4


class _AllToAllBytes(TorchDispatchMode):
    """Test-local meter: (bytes sent to other ranks, bytes received from them) of every
    all-to-all issued while active: the uneven functional one the dispatch and combine use
    (``_c10d_functional::all_to_all_single``, rows of its splits) and the even
    ``c10d::alltoall_base_`` of the counts. Rows to this rank itself are not counted.
    ``grouped_mm``: how many ``aten::_grouped_mm`` ran (forward and backward)."""

    def __init__(self, rank: int, ep: int) -> None:
        super().__init__()
        self.rank, self.ep, self.calls, self.grouped_mm = rank, ep, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, arg_names = op_schema(func)
        values = dict(zip(arg_names, args)) | (kwargs or {})
        if name == "_c10d_functional::all_to_all_single":
            t = values["input"]
            row = math.prod(t.shape[1:]) * t.element_size()
            off = [s for i, s in enumerate(values["input_split_sizes"]) if i != self.rank]
            on = [s for i, s in enumerate(values["output_split_sizes"]) if i != self.rank]
            self.calls.append((sum(off) * row, sum(on) * row))
        elif name == "aten::_grouped_mm":
            self.grouped_mm += 1
        elif name == "c10d::alltoall_base_":  # even splits: numel / ep to each rank
            t = values["input"]
            moved = (self.ep - 1) * t.numel() // self.ep * t.element_size()
            self.calls.append((moved, moved))
        return func(*args, **(kwargs or {}))


def _case(case: int, ep: int, rank: int, group=None) -> dict:
    """Case ``case`` on EP rank ``rank`` of ``group`` (None: the world, of size ep): one
    forward and backward, with the all-to-alls measured."""
    family, dtype, kind = CASES[case]
    E = _num_experts(ep, kind)
    d = routing(kind, rank, ep, E, seed=case, dtype=dtype)
    module = ExpertParallelExperts(experts(family, E, dtype), group)
    x, w = d["x"].clone().requires_grad_(), d["weights"].clone().requires_grad_()
    with _AllToAllBytes(rank, ep) as spy, CommMeter({}) as meter:
        y = module(x, d["index"], w)
        (y * d["dy"]).sum().backward()
    s = module.global_expert_slice()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "slice": (s.start, s.stop),
            "grads": {n: p.grad for n, p in module.named_parameters()},
            "a2a": spy.calls, "grouped_mm": spy.grouped_mm, "meter": dict(meter.bytes),
            "last": meter.last, "module": module}


# at world 4, also run on two ep = 2 groups {0, 1} and {2, 3}
SUBGROUP_CASES = (0, CASES.index(("gpt_oss", torch.float64, "random")), len(CASES) - 1)


def _worker(rank: int, world: int) -> dict:
    cases = [_case(i, world, rank) for i in range(len(CASES))]
    out = {"cases": cases, "repeat": _case(0, world, rank)}  # bit-equal to cases[0]?
    family, dtype, kind = CASES[-1]
    try:  # expert ids outside [0, E): refused on every rank before any collective
        cases[-1]["module"](torch.zeros(1, H, dtype=dtype),
                            torch.tensor([[0, _num_experts(world, kind)]]),
                            torch.ones(1, 2, dtype=dtype))
    except ValueError as exc:
        out["bad_ids"] = str(exc)
    for c in cases + [out["repeat"]]:
        del c["module"]  # holds a process group: not picklable
    if world == 4:
        timeout = timedelta(seconds=PG_TIMEOUT_S)
        groups = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
        mine = groups[rank // 2]
        out["sub"] = {i: _case(i, 2, dist.get_rank(mine), mine) for i in SUBGROUP_CASES}
        for c in out["sub"].values():
            del c["module"]
        try:  # E = 6 experts cannot be split over 4 ranks
            ExpertParallelExperts(experts("mixtral", 6))
        except ValueError as exc:
            out["refusal"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs():
    """ep -> the per-rank results of :func:`_worker` at that world size (launched once)."""
    cache: dict[int, list[dict]] = {}

    def get(ep: int) -> list[dict]:
        if ep not in cache:
            cache[ep] = run_distributed(_worker, ep, timeout_s=300)
        return cache[ep]
    return get


@functools.lru_cache(maxsize=None)
def _reference(case: int, ep: int) -> dict:
    """The original module on every rank's tokens at once: y, dx, dw per rank, the weight
    gradients of all E experts, and the routings."""
    family, dtype, kind = CASES[case]
    E = _num_experts(ep, kind)
    data = [routing(kind, r, ep, E, seed=case, dtype=dtype) for r in range(ep)]
    module = experts(family, E, dtype)
    x = torch.cat([d["x"] for d in data]).requires_grad_()
    w = torch.cat([d["weights"] for d in data]).requires_grad_()
    y = module(x, torch.cat([d["index"] for d in data]), w)
    (y * torch.cat([d["dy"] for d in data])).sum().backward()
    sizes = [len(d["x"]) for d in data]
    return {"y": y.detach().split(sizes), "dx": x.grad.split(sizes), "dw": w.grad.split(sizes),
            "grads": {n: p.grad for n, p in module.named_parameters()},
            "index": [d["index"] for d in data], "E": E}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference; NaN or inf on either side fails (never a zero difference)."""
    assert got is not None and got.shape == want.shape, (None if got is None else got.shape,
                                                         want.shape)
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    return (got.double() - want.double()).abs().max().item() if got.numel() else 0.0


def _errors(case: int, ep: int, results: list[dict]) -> dict[str, float]:
    """Max abs error per output, input gradient and parameter over the ranks ``results``
    (each case ``case`` at ``ep``, in EP rank order) against the single-process module."""
    ref, errors = _reference(case, ep), {}
    for r, got in enumerate(results):
        for key in ("y", "dx", "dw"):
            errors[key] = max(errors.get(key, 0.0), _err(got[key], ref[key][r]))
        start, stop = got["slice"]
        assert (start, stop) == (r * ref["E"] // ep, (r + 1) * ref["E"] // ep)
        assert sorted(got["grads"]) == sorted(ref["grads"])  # the original's names
        for name, grad in got["grads"].items():
            errors[name] = max(errors.get(name, 0.0), _err(grad, ref["grads"][name][start:stop]))
    return errors


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{f}-{str(t)[6:]}-{k}" for f, t, k in CASES])
@pytest.mark.parametrize("ep", EPS)
def test_forward_and_gradients_equal_one_process(runs, ep, case):
    errors = _errors(case, ep, [res["cases"][case] for res in runs(ep)])
    print(f"ep={ep} {CASES[case]}: max abs errors {errors}")
    assert max(errors.values()) <= TOLERANCE[CASES[case][1]], errors


@pytest.mark.parametrize("ep", EPS)
def test_skewed_routing_leaves_an_expert_and_ranks_empty(ep):
    """The premise of the skewed cases: expert 0 gets no token and some rank receives none."""
    ref = _reference(CASES.index(("mixtral", torch.float64, "skewed")), ep)
    per_expert = torch.bincount(torch.cat(ref["index"]).reshape(-1), minlength=ref["E"])
    assert per_expert[0] == 0
    assert (per_expert.view(ep, -1).sum(1) == 0).any()
    assert len(ref["index"][-1]) == 0


@pytest.mark.parametrize("ep", EPS)
def test_all_to_all_bytes_equal_the_prediction(runs, ep):
    """Per rank and case: the count exchange, dispatch and combine forward, then the
    combine's and the dispatch's backward (splits swapped) move what dispatch_bytes says
    for the routing of that step."""
    for case, (family, dtype, kind) in enumerate(CASES):
        ref = _reference(case, ep)
        itemsize = torch.empty((), dtype=dtype).element_size()
        for r, res in enumerate(runs(ep)):
            p = dispatch_bytes(ref["index"], ref["E"], ep, r, H, itemsize)
            want = [(p["count_exchange"],) * 2, (p["dispatch_sent"], p["dispatch_received"]),
                    (p["combine_sent"], p["combine_received"]),
                    (p["combine_received"], p["combine_sent"]),
                    (p["dispatch_received"], p["dispatch_sent"])]
            assert res["cases"][case]["a2a"] == want, (CASES[case], r)


@pytest.mark.parametrize("ep", EPS)
def test_comm_meter_counts_the_expert_all_to_alls(runs, ep):
    """CommMeter's "ep_all_to_all": what this rank sends to others in the count exchange,
    the dispatch and the combine, and both again in backward (predicted by dispatch_bytes);
    nothing else is counted (the world is the EP group here, no other collective runs)."""
    ref = _reference(0, ep)
    for r, res in enumerate(runs(ep)):
        p = dispatch_bytes(ref["index"], ref["E"], ep, r, H, 8)
        predicted = p["count_exchange"] + 2 * (p["dispatch_sent"] + p["combine_sent"])
        measured = res["cases"][0]["meter"]["ep_all_to_all"]
        assert sum(res["cases"][0]["meter"].values()) == measured
        print(f"ep={ep} rank {r}: CommMeter {measured} B, predicted {predicted} B sent, "
              f"last op {res['cases'][0]['last']}")
        assert measured == predicted


def test_experts_not_divisible_by_ep_are_refused(runs):
    for res in runs(4):
        assert "E=6 experts are not divisible by ep=4; choose ep in [1, 2, 3, 6]" in res["refusal"]


@pytest.mark.parametrize("ep", EPS)
def test_expert_ids_outside_the_experts_are_refused(runs, ep):
    E = _num_experts(ep, CASES[-1][2])
    for res in runs(ep):
        assert f"GptOssExperts: top_k_index holds expert ids outside [0, {E})" in res["bad_ids"]


@pytest.mark.parametrize("case", SUBGROUP_CASES)
def test_ep_groups_smaller_than_the_world_use_their_group_rank(runs, case):
    """World 4, two EP groups of 2: each group equals the single-process module (its rank
    in the group, not the world, picks the experts and the all-to-all peers)."""
    results = runs(4)
    for group in ((0, 1), (2, 3)):
        errors = _errors(case, 2, [results[r]["sub"][case] for r in group])
        assert max(errors.values()) <= TOLERANCE[CASES[case][1]], (group, errors)


def test_float32_runs_grouped_mm_and_float64_the_loop(runs):
    """grouped_mm has a CPU kernel for float32 (rows of 16-byte multiples), none for
    float64: 2 grouped matmuls forward, 4 backward (input and weight gradients) or none."""
    for ep in EPS:
        for res in runs(ep):
            for case, (_, dtype, _) in enumerate(CASES):
                assert res["cases"][case]["grouped_mm"] == (6 if dtype == torch.float32 else 0)


def test_a_step_repeats_bit_for_bit(runs):
    """Stable sorts, unique-index gathers and a fixed-order sum over k: the same step twice
    gives the same bits."""
    for ep in EPS:
        for res in runs(ep):
            first, again = res["cases"][0], res["repeat"]
            for key in ("y", "dx", "dw"):
                assert torch.equal(first[key], again[key]), key
            for name, grad in first["grads"].items():
                assert torch.equal(grad, again["grads"][name]), name
