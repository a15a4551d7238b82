"""Context parallelism trains equal to one process, and communicates what the plan
predicts: autopar's GPT (fx symbolic trace) and a Hugging Face Llama (torch.export, its
causal mask built from aranges, rotary positions) at cp = 2 alone and beside tp = 2
(sequence parallelism, selective recompute: the recomputed attention gathers K and V
again), pp = 2 and dp = 2, pairwise over the two models, on real gloo process groups:

* ``autopar.verify`` (2 SGD steps, fp32): losses, every gradient and parameter against the
  one-process run within the verify tolerances, and the plan's prediction its own
  (``claims``: re-priced, the same);
* the second step of a run of the same plan: the payload bytes of every collective kind
  (``cp_all_gather``, ``cp_reduce_scatter`` among them) measured by the CommMeter equal the
  plan's prediction for the rank's stage, exactly;
* GPT cp2 under ZeRO-3 (FSDP2 over the c·d axis) alike, and a checkpoint saved under cp2
  loads under dp2 and on one process (cp shards nothing of the model).
"""

from __future__ import annotations

import pytest
import torch

import autopar
from dist_utils import run_distributed
from helpers import load_script, optimizer

zoo = load_script("benchmarks/model_zoo.py")

# (family, tp, pp, dp, ZeRO stage: the solver's when None) with cp = 2; ZeRO-3 shards over
# the c·d data-parallel axis (FSDP2's mesh)
CASES = [("autopar-gpt", 1, 1, 1, None), ("autopar-gpt", 2, 1, 1, None), ("llama", 1, 2, 1, None),
         ("llama", 1, 1, 2, None), ("autopar-gpt", 1, 1, 1, 3)]


def _train(rank: int, world: int, family: str, plan) -> tuple[dict, dict, int]:
    """(verify's report, the second step's measured stats, this rank's pipeline rank)."""
    from autopar.verify.check import verify

    model = zoo.build(family, "tiny", layers=plan.stage_layers[-1][1])
    report = verify(model, plan, steps=2, raise_on_failure=False).to_dict()
    pm = autopar.parallelize(model, plan=plan, optimizer=optimizer("sgd"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        idx = torch.randint(0, zoo.TINY["vocab"], (plan.global_batch_size, plan.seq_len),
                            generator=gen)
        pm.train_step(idx, idx.roll(-1, 1))
    return report, pm.last_step_stats(), pm.groups.pp_rank


@pytest.mark.parametrize("family, tp, pp, dp, zero", CASES, ids=[
    f"{f}-cp2-tp{t}-pp{p}-dp{d}" + (f"-zero{z}" if z else "") for f, t, p, d, z in CASES])
def test_context_parallel_trains_equal_to_one_process(family, tp, pp, dp, zero):
    pins = {} if zero is None else {"zero_stage": zero}
    plan = zoo.tiny_plan(family, dict(tp=tp, pp=pp, dp=dp, cp=2, **pins))
    assert plan.cp == 2 and plan.num_gpus == 2 * tp * pp * dp and zero in (None, plan.zero_stage)
    assert plan.predicted.comm_bytes_by_kind["cp_all_gather"] > 0
    results = run_distributed(_train, plan.num_gpus, family, plan, timeout_s=300)
    report = results[0][0]
    assert report["ok"], report
    assert report["claims"] == "" and report["max_grad_diff"] <= report["tolerances"]["grad"]
    for _, stats, stage in results:
        predicted = plan.predicted.stage_stats[stage]["comm_bytes"]
        kinds = set(stats["comm_bytes"]) | {k for k, v in predicted.items() if v}
        assert {k: stats["comm_bytes"].get(k, 0) for k in kinds} == \
            {k: predicted.get(k, 0) for k in kinds}


def _batch(plan) -> tuple:
    idx = torch.randint(0, zoo.TINY["vocab"], (plan.global_batch_size, plan.seq_len),
                        generator=torch.Generator().manual_seed(0))
    return idx, idx.roll(-1, 1)


def _save(rank: int, world: int, plan, path: str) -> tuple:
    """One AdamW step under ``plan``, a checkpoint, then two more steps' losses."""
    pm = autopar.parallelize(zoo.build("llama", "tiny"), plan=plan, optimizer=optimizer("adamw"))
    pm.train_step(*_batch(plan))
    pm.save_checkpoint(path)
    state = pm.full_state_dict()
    return (state if rank == 0 else None), [pm.train_step(*_batch(plan)) for _ in range(2)]


def _load(rank: int, world: int, plan, path: str) -> tuple:
    pm = autopar.parallelize(zoo.build("llama", "tiny"), plan=plan, optimizer=optimizer("adamw"))
    pm.load_checkpoint(path)
    state = pm.full_state_dict()
    return (state if rank == 0 else None), [pm.train_step(*_batch(plan)) for _ in range(2)]


def test_a_checkpoint_saved_under_cp_loads_without_it(tmp_path):
    """cp shards nothing of the model: a checkpoint of cp2 (ZeRO-1: AdamW's states over the
    c·d axis) loads under dp2 and on one process, the same parameters, and the losses of the
    two steps after it agree (fp32 rounding): the second one's parameters took an update
    with the loaded optimizer states."""
    path = str(tmp_path / "ck")
    cp2 = zoo.tiny_plan("llama", dict(tp=1, pp=1, dp=1, cp=2, zero_stage=1))
    saved = run_distributed(_save, 2, cp2, path, timeout_s=300)[0]
    for layout in (dict(tp=1, pp=1, dp=2, zero_stage=1), dict(tp=1, pp=1, dp=1, zero_stage=1)):
        plan = zoo.tiny_plan("llama", layout)
        loaded = run_distributed(_load, plan.num_gpus, plan, path, timeout_s=300)[0]
        assert saved[0].keys() == loaded[0].keys()
        assert all(torch.equal(saved[0][k], loaded[0][k]) for k in saved[0])
        assert loaded[1] == pytest.approx(saved[1], rel=1e-6)  # NaN fails
