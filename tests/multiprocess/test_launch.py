"""autopar.runtime.launch: results in rank order, a failing rank named with its traceback,
a stuck collective failing at the process-group timeout, a hung run killed at the wall
clock timeout."""

from __future__ import annotations

import time

import pytest

from autopar.runtime.launch import launch


def _ranks(rank: int, world: int, tag: str) -> tuple:
    import torch
    import torch.distributed as dist

    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    return tag, rank, world, dist.get_world_size(), x.item(), torch.get_num_threads()


def _raises_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    time.sleep(30)  # killed by the launcher once rank 1 has failed


def _stuck_collective(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        time.sleep(60)  # never joins the barrier
    dist.barrier()


def _hangs(rank: int, world: int) -> None:
    time.sleep(120)


def test_results_come_back_in_rank_order():
    assert launch(_ranks, 2, "x") == [("x", 0, 2, 2, 3.0, 1), ("x", 1, 2, 2, 3.0, 1)]


def test_a_failing_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 1 failed: ValueError: boom on purpose\n") as err:
        launch(_raises_on_rank_1, 2, timeout_s=60)
    assert "_raises_on_rank_1" in str(err.value)  # the rank's traceback
    assert time.monotonic() - start < 30  # rank 0 was killed, not waited for


def test_a_stuck_collective_fails_at_the_process_group_timeout():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        launch(_stuck_collective, 2, timeout_s=50, pg_timeout_s=3)


def test_a_hung_run_is_killed_at_the_wall_clock_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 8 s"):
        launch(_hangs, 2, timeout_s=8)
    assert time.monotonic() - start < 30
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(_hangs, 0)
