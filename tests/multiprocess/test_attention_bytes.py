"""What the fused attention kernel keeps, measured: a GPT (``y.transpose(1, 2).contiguous()``
before its output projection, as nanoGPT and Hugging Face write it) trained under
``Cluster.attention = "flash"`` saves the bytes the plan predicts within 2%, in fp32 and in
bf16, on one process (the few KB left, 1% of this tiny model, are 0.3% at h = 128). PyTorch's CPU flash kernel keeps its output and an
fp32 log-sum-exp as the GPU kernels do (``autopar.graph.attention``); the output is the
projection's saved input, so counting it twice (the accounting before the GPU check)
predicts about 6% too much here and fails. With tp > 1 the output is still counted: a
placement may copy it before the projection (a gather, a slice), and then the kernel's
output and the projection's input are two tensors (tests/multiprocess/test_parallelize.py
holds those plans to 5%)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from dist_utils import run_distributed
from helpers import CONFIG, fast_cluster, seeded_gpt

BATCH, SEQ = 4, 16


def _saved(rank: int, world: int, plan) -> tuple[float, float]:
    import torch

    import autopar

    pm = autopar.parallelize(seeded_gpt(), plan=plan, measure_every=1,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    pm.train_step(idx, torch.roll(idx, -1, dims=1))
    predicted = plan.predicted.stage_stats[pm.groups.pp_rank]["saved_activation_bytes"]
    return pm.last_step_stats()["saved_activation_bytes"], predicted


@pytest.mark.parametrize("tp,dtype", [(1, "fp32"), (1, "bf16")])
def test_saved_activations_of_the_fused_kernel_match_the_prediction(tp, dtype):
    import torch

    import autopar

    with torch.device("meta"):
        meta = seeded_gpt()
    cluster = dataclasses.replace(fast_cluster(tp), dtype=dtype)
    assert cluster.attention == "flash"
    plan = autopar.plan(meta, cluster, global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(tp=tp, pp=1, dp=1, micro_batch_size=BATCH,
                                              recompute="none", dtype=dtype))
    for measured, predicted in run_distributed(_saved, tp, plan, timeout_s=120):
        assert abs(measured / predicted - 1) < 0.02, (measured, predicted)
