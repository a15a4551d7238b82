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
  plan's prediction for the rank's stage, exactly.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from dist_utils import run_distributed
from helpers import load_script, optimizer

zoo = load_script("benchmarks/model_zoo.py")

# (family, tp, pp, dp) with cp = 2
CASES = [("autopar-gpt", 1, 1, 1), ("autopar-gpt", 2, 1, 1), ("llama", 1, 2, 1),
         ("llama", 1, 1, 2)]


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


@pytest.mark.parametrize("family, tp, pp, dp", CASES,
                         ids=[f"{f}-cp2-tp{t}-pp{p}-dp{d}" for f, t, p, d in CASES])
def test_context_parallel_trains_equal_to_one_process(family, tp, pp, dp):
    plan = zoo.tiny_plan(family, dict(tp=tp, pp=pp, dp=dp, cp=2))
    assert plan.cp == 2 and plan.num_gpus == 2 * tp * pp * dp
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
