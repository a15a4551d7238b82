"""autopar.techniques.context_parallel (the record) and the sequence split of
autopar.runtime.context_parallel, in process: head-tail chunks, positions, refusals, rank
order, and shard/unshard as inverse permutations of the tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.runtime.context_parallel import (context_parallel_attention, shard_sequence,
                                              unshard_sequence)
from autopar.techniques.context_parallel import (cp_problem, cp_ranks, local_positions,
                                                 sequence_chunks)


def test_head_tail_chunks_balance_causal_work():
    cp = 4
    held = [sequence_chunks(cp, r) for r in range(cp)]
    assert held == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert sorted(j for pair in held for j in pair) == list(range(2 * cp))
    # chunk j attends j + 1 chunks of keys: every rank computes 2cp + 1 blocks
    assert {sum(j + 1 for j in pair) for pair in held} == {2 * cp + 1}


def test_local_positions_are_each_ranks_tokens_in_its_order():
    assert local_positions(16, 2, 0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions(8, 1, 0) == list(range(8))
    with pytest.raises(ValueError, match=r"2·cp=8 equal chunks.*seq_len=12"):
        local_positions(12, 4, 0)


def test_refusals_name_the_cause_and_the_fix():
    assert cp_problem(1, 7) is None and cp_problem(2, 64) is None
    assert "choose a cp with 2·cp | 30" in cp_problem(4, 30)
    assert "set the attention dropout to 0" in cp_problem(2, 64, attention_dropout=0.1)
    assert "positive" in cp_problem(0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        sequence_chunks(2, 2)


def test_rank_order_is_tp_cp_dp():
    tp, cp, dp = 2, 2, 2  # stage rank j = tp_rank + t·(cp_rank + c·dp_rank)
    assert cp_ranks(0, tp, cp, dp) == (0, [0, 2])
    assert cp_ranks(3, tp, cp, dp) == (1, [1, 3])
    assert cp_ranks(5, tp, cp, dp) == (0, [5, 7])
    groups = {tuple(cp_ranks(j, tp, cp, dp)[1]) for j in range(tp * cp * dp)}
    assert sorted(r for g in groups for r in g) == list(range(8))  # a partition
    with pytest.raises(ValueError, match="outside"):
        cp_ranks(8, tp, cp, dp)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_and_unshard_are_inverse(cp):
    x = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    parts = [shard_sequence(x, cp, r, dim=1) for r in range(cp)]
    assert all(p.shape == (2, 16 // cp, 3) for p in parts)
    assert torch.equal(unshard_sequence(parts, dim=1), x)
    if cp > 1:  # rank 0 holds the first and the last chunk
        c = 16 // (2 * cp)
        assert torch.equal(parts[0][:, :c], x[:, :c]) and torch.equal(parts[0][:, c:], x[:, -c:])
    with pytest.raises(ValueError, match="2·cp"):
        shard_sequence(torch.zeros(1, 6), 2, 0)


def test_one_rank_is_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    assert torch.equal(context_parallel_attention(q, k, v, None),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_a_plans_cp_is_saved_checked_and_counted_in_its_gpus():
    import dataclasses

    from autopar.contract.errors import PlanError
    from autopar.contract.plan import Layout, Plan
    from autopar.contract.plan_check import check_plan
    from helpers import tiny_plan

    assert Layout.parse("tp=2,cp=4").cp == 4
    with pytest.raises(ValueError, match="Layout.cp must be a positive int"):
        Layout(cp=0)
    base = tiny_plan(1, 1, 2)
    assert "cp" not in base.to_dict()  # a plan without CP reads as before
    plan = dataclasses.replace(base, dp=1, cp=2, global_batch_size=base.global_batch_size // 2)
    assert Plan.from_json(plan.to_json()) == plan and plan.to_dict()["cp"] == 2
    assert plan.num_gpus == 2 and plan.layout().cp == 2 and " cp=2 " in plan.headline()
    assert plan.decision_digest() != dataclasses.replace(plan, cp=1).decision_digest()
    check_plan(plan, world_size=2)
    with pytest.raises(PlanError, match=r"tp\*cp\*pp\*dp = 1\*2\*1\*1 = 2 processes"):
        check_plan(plan, world_size=4)
    with pytest.raises(PlanError, match="cp.*choose a cp with 2·cp"):  # s = 16
        check_plan(dataclasses.replace(plan, cp=16))
