"""Multi-process gloo tests of autopar.runtime against single-process references.

Each distributed run spawns CPU processes (tests/dist_utils.py); the reference runs in
the pytest process. Runs are shared between tests through module-scoped fixtures to
keep the file fast on two cores.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.runtime.engine import ParallelModule, token_cross_entropy
from autopar.runtime.mesh import ParallelGroups
from autopar.runtime.stats import CommMeter
from autopar.runtime.tp_modules import CopyToTPRegion as TPCopy
from autopar.runtime.tp_modules import GatherFromTPRegion as TPAllGather
from autopar.runtime.tp_modules import ReduceFromTPRegion as TPAllReduce
from autopar.runtime.tp_modules import ScatterToTPRegion as TPScatter
from autopar.runtime.vocab_parallel import VocabParallelEmbedding
from dist_utils import run_distributed

V, H, S, MBS, M, STEPS, LR = 32, 16, 8, 2, 2, 3, 0.1
B_, S_, HID = 2, 4, 8  # shapes of the TP-operator tests


# ---------------------------------------------------------------- TP operators, tp = 2

def _tp_data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(B_, S_, HID, generator=g),
        "a_w": torch.randn(4 * HID, HID, generator=g) / HID**0.5, "a_b": torch.randn(4 * HID, generator=g),
        "b_w": torch.randn(HID, 4 * HID, generator=g) / HID**0.5, "b_b": torch.randn(HID, generator=g),
        "w_out": torch.randn(B_, S_, HID, generator=g),
        "emb": torch.randn(V, HID, generator=g), "idx": torch.randint(0, V, (B_, S_), generator=g),
    }


def _mlp_tp(d: dict[str, torch.Tensor], groups: ParallelGroups) -> dict:
    """Column-split A, GELU, row-split B with f/g: Z = g(GELU(f(X) A_i) B_i) + b_B."""
    r, n = groups.tp_rank, 4 * HID // groups.tp
    a_w = d["a_w"][r * n : (r + 1) * n].clone().requires_grad_()  # (4h/t, h)
    a_b = d["a_b"][r * n : (r + 1) * n].clone().requires_grad_()
    b_w = d["b_w"][:, r * n : (r + 1) * n].clone().requires_grad_()  # (h, 4h/t)
    b_b = d["b_b"].clone().requires_grad_()
    x = d["x"].clone().requires_grad_()
    f, g = TPCopy(groups.tp_group), TPAllReduce(groups.tp_group)
    with CommMeter(groups.axis_names()) as meter:
        z = g(F.linear(F.gelu(F.linear(f(x), a_w, a_b)), b_w)) + b_b  # (b, s, h)
        (z * d["w_out"]).sum().backward()
    return {"z": z.detach(), "x_grad": x.grad, "a_w": a_w.grad, "a_b": a_b.grad, "b_w": b_w.grad,
            "b_b": b_b.grad, "bytes": dict(meter.bytes), "repr": repr(f) + repr(g)}


def _gather_scatter_embedding(d: dict[str, torch.Tensor], groups: ParallelGroups) -> dict:
    """Gather along dim 1, scatter along dim -1, vocab-parallel embedding + all-reduce."""
    r, t = groups.tp_rank, groups.tp
    x = d["x"]
    x_part = x.chunk(t, dim=1)[r].clone().requires_grad_()  # (b, s/t, h)
    gathered = TPAllGather(groups.tp_group, 1)(x_part)  # (b, s, h)
    (gathered * d["w_out"]).sum().backward()
    x_full = x.clone().requires_grad_()
    scattered = TPScatter(groups.tp_group, -1)(x_full)  # (b, s, h/t)
    (scattered * d["w_out"].chunk(t, dim=-1)[r]).sum().backward()
    emb = VocabParallelEmbedding.from_full(d["emb"], r, t)
    out = TPAllReduce(groups.tp_group)(emb(d["idx"]))  # (b, s, h)
    (out * d["w_out"]).sum().backward()
    return {"gathered": gathered.detach(), "gather_grad": x_part.grad, "scattered": scattered.detach(),
            "scatter_grad": x_full.grad, "emb_out": out.detach(), "emb_grad": emb.weight.grad}


def _tp_ops_worker(rank: int, world_size: int) -> dict:
    try:
        ParallelGroups.build(tp=2, pp=2, dp=1)  # 4 ranks asked of a world of 2
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    groups = ParallelGroups.build(tp=2, pp=1, dp=1)
    d = _tp_data()
    return {"mlp": _mlp_tp(d, groups), "ops": _gather_scatter_embedding(d, groups),
            "mismatch": mismatch}


@pytest.fixture(scope="module")
def tp_results(world2: list[dict]) -> list[dict]:
    return [r["tp_ops"] for r in world2]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rtol * max(b.abs().max().item(), 1e-12))


def test_f_g_mlp_matches_unsplit(tp_results: list[dict]) -> None:
    d = _tp_data()
    params = {k: d[k].clone().requires_grad_() for k in ("a_w", "a_b", "b_w", "b_b")}
    x = d["x"].clone().requires_grad_()
    z = F.linear(F.gelu(F.linear(x, params["a_w"], params["a_b"])), params["b_w"], params["b_b"])
    (z * d["w_out"]).sum().backward()
    res = [r["mlp"] for r in tp_results]
    for r in res:
        assert _close(r["z"], z.detach()) and _close(r["x_grad"], x.grad) and _close(r["b_b"], params["b_b"].grad)
    assert _close(torch.cat([r["a_w"] for r in res], 0), params["a_w"].grad)
    assert _close(torch.cat([r["a_b"] for r in res], 0), params["a_b"].grad)
    assert _close(torch.cat([r["b_w"] for r in res], 1), params["b_w"].grad)
    # one all-reduce of (b, s, h) fp32 forward (g) and one backward (f)
    assert res[0]["bytes"]["tp_all_reduce"] == 2 * B_ * S_ * HID * 4
    assert "tp=2" in res[0]["repr"] and "copy_to_tp_region" in res[0]["repr"]
    assert "reduce_from_tp_region" in res[0]["repr"]


def test_gather_scatter_embedding_match_unsplit(tp_results: list[dict]) -> None:
    d = _tp_data()
    emb = d["emb"].clone().requires_grad_()
    out = F.embedding(d["idx"], emb)
    (out * d["w_out"]).sum().backward()
    for rank, r in enumerate(x["ops"] for x in tp_results):
        assert torch.equal(r["gathered"], d["x"])
        assert torch.equal(r["gather_grad"], d["w_out"].chunk(2, dim=1)[rank])
        assert torch.equal(r["scattered"], d["x"].chunk(2, dim=-1)[rank])
        assert torch.equal(r["scatter_grad"], d["w_out"])
        assert _close(r["emb_out"], out.detach())
        assert _close(r["emb_grad"], emb.grad.chunk(2, dim=0)[rank])


# ---------------------------------------------------------------- ParallelModule

class TinyGPT(nn.Module):
    """Embedding -> 2 x (Linear + tanh) -> head tied to the embedding. idx (b, s) -> (b, s, V)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.fc1, self.fc2 = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc2(torch.tanh(self.fc1(self.wte(idx)))))  # (b, s, h)
        return x @ self.wte.weight.T  # (b, s, V)


def _shard(t: torch.Tensor, dim: int | None, groups: ParallelGroups) -> torch.Tensor:
    """This TP rank's chunk of a full tensor along dim (None: replicated), as a fresh Parameter."""
    part = t.detach() if dim is None else t.detach().chunk(groups.tp, dim)[groups.tp_rank]
    return nn.Parameter(part.clone())


class FirstStage(nn.Module):
    """Vocab-parallel embedding + g, then f, column-split fc1, all-gather, tanh: idx (b, s) -> (b, s, h)."""

    def __init__(self, ref: TinyGPT, groups: ParallelGroups) -> None:
        super().__init__()
        tp_group = groups.tp_group
        self.wte = VocabParallelEmbedding(_shard(ref.wte.weight, 0, groups), groups.tp_rank * V // groups.tp)
        self.wte_reduce, self.fc1_copy = TPAllReduce(tp_group), TPCopy(tp_group)
        self.fc1_weight = _shard(ref.fc1.weight, 0, groups)  # (h/t, h)
        self.fc1_bias = _shard(ref.fc1.bias, 0, groups)  # (h/t,)
        self.fc1_gather = TPAllGather(tp_group, -1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.fc1_copy(self.wte_reduce(self.wte(idx)))  # (b, s, h)
        return torch.tanh(self.fc1_gather(F.linear(x, self.fc1_weight, self.fc1_bias)))  # (b, s, h)


class LastStage(nn.Module):
    """Scatter, row-split fc2, g, tanh, then f, vocab-split tied head, all-gather: (b, s, h) -> (b, s, V)."""

    def __init__(self, ref: TinyGPT, groups: ParallelGroups) -> None:
        super().__init__()
        tp_group = groups.tp_group
        self.fc2_scatter, self.fc2_reduce = TPScatter(tp_group, -1), TPAllReduce(tp_group)
        self.fc2_weight = _shard(ref.fc2.weight, 1, groups)  # (h, h/t)
        self.fc2_bias = _shard(ref.fc2.bias, None, groups)  # (h,)
        self.head_copy, self.head_gather = TPCopy(tp_group), TPAllGather(tp_group, -1)
        self.head_weight = _shard(ref.wte.weight, 0, groups)  # tied copy (V/t, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2_reduce(F.linear(self.fc2_scatter(x), self.fc2_weight)) + self.fc2_bias  # (b, s, h)
        return self.head_gather(self.head_copy(torch.tanh(y)) @ self.head_weight.T)  # (b, s, V)


# stage parameter -> (reference parameter, dim it is split along over TP or None)
STAGE_PARAMS = MappingProxyType({
    "wte.weight": ("wte.weight", 0), "fc1_weight": ("fc1.weight", 0), "fc1_bias": ("fc1.bias", 0),
    "fc2_weight": ("fc2.weight", 1), "fc2_bias": ("fc2.bias", None), "head_weight": ("wte.weight", 0),
})


def _batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = dp * MBS * M
    return [(torch.randint(0, V, (rows, S), generator=g), torch.randint(0, V, (rows, S), generator=g))
            for _ in range(STEPS)]


def _reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for idx, targets in _batches(dp):
        loss = token_cross_entropy(model(idx), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _engine_worker(rank: int, world_size: int, tp: int, pp: int, dp: int, schedule: str) -> dict:
    groups = ParallelGroups.build(tp, pp, dp)
    torch.manual_seed(0)
    ref = TinyGPT()
    if pp == 1:  # tp == 1 here: the whole model, truly tied
        stage, tied, where = ref, (), {n: (n, None) for n, _ in ref.named_parameters()}
    else:
        stage = FirstStage(ref, groups) if groups.is_first_stage else LastStage(ref, groups)
        tied = ("wte.weight",) if groups.is_first_stage else ("head_weight",)
        where = STAGE_PARAMS
    pm = ParallelModule(stage, groups, micro_batch_size=MBS, num_micro_batches=M, seq_len=S, hidden_size=H,
                        schedule=schedule, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR),
                        tied_parameter_names=tied, logits_width=V)
    losses = [pm.train_step(idx, targets) for idx, targets in _batches(dp)]
    params = [(*where[n], p.detach().clone()) for n, p in stage.named_parameters()]
    try:
        pm.train_step(*(t[:-1] for t in _batches(dp)[0]))
        bad_batch = "no error"
    except ValueError as e:
        bad_batch = str(e)
    return {"losses": losses, "params": params, "tp_rank": groups.tp_rank, "bad_batch": bad_batch}


# Every layout of one world size runs in one spawn (spawning and importing torch
# dominates the time): (tp, pp, dp, schedule).
WORLD2 = ((1, 2, 1, "1f1b"), (1, 2, 1, "gpipe"), (1, 1, 2, "1f1b"))
WORLD4 = ((1, 2, 2, "1f1b"), (2, 2, 1, "1f1b"))


def _world_worker(rank: int, world_size: int, layouts: tuple[tuple, ...], with_tp_ops: bool) -> dict:
    out: dict = {"tp_ops": _tp_ops_worker(rank, world_size)} if with_tp_ops else {}
    for layout in layouts:
        out[layout] = _engine_worker(rank, world_size, *layout)
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_distributed(_world_worker, 2, WORLD2, True)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_distributed(_world_worker, 4, WORLD4, False)


@pytest.mark.parametrize("tp,pp,dp,schedule", WORLD2 + WORLD4)
def test_parallel_module_matches_single_process(
    tp: int, pp: int, dp: int, schedule: str, request: pytest.FixtureRequest
) -> None:
    world = request.getfixturevalue("world2" if tp * pp * dp == 2 else "world4")
    results = [r[(tp, pp, dp, schedule)] for r in world]
    ref_losses, ref_params = _reference(dp)
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        for ref_name, dim, value in res["params"]:
            want = ref_params[ref_name] if dim is None else ref_params[ref_name].chunk(tp, dim)[res["tp_rank"]]
            assert value.shape == want.shape and _close(value, want), f"rank {rank} {ref_name}"
        assert "global batch" in res["bad_batch"], res["bad_batch"]
    assert len({tuple(r["losses"]) for r in results}) == 1  # the same float on every rank
    assert not torch.equal(ref_params["wte.weight"], TinyGPT().wte.weight)  # training moved it


def test_world_size_mismatch_raises_before_any_collective(tp_results: list[dict]) -> None:
    for r in tp_results:  # both ranks raised, then built the right groups and ran collectives
        assert "plan needs tp*pp*dp = N = 2*2*1 = 4 GPUs but world size is 2" in r["mismatch"]
