"""A model's own ``torch.autograd.Function`` (``tests/stack_models.py``'s
``FunctionLM``: forward x·k, backward 100·g) trains by its own backward in the parallel
program: ``verify`` at tp2 and pp2 on real gloo groups against one process, whose
gradient is the Function's rule (a program that differentiated the forward's ops instead
would be 50× off)."""

from __future__ import annotations

import pytest
import torch

import autopar
from dist_utils import run_distributed
from helpers import fast_cluster
from stack_models import FunctionLM

LAYOUTS = {"tp2": dict(tp=2, pp=1, dp=1, micro_batch_size=4),
           "pp2": dict(tp=1, pp=2, dp=1, micro_batch_size=2)}


def _rank(rank: int, world: int, plan) -> dict:
    from autopar.verify.check import verify

    torch.manual_seed(0)
    return verify(FunctionLM(), plan, steps=2, raise_on_failure=False).to_dict()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_custom_function_trains_by_its_own_backward(layout):
    torch.manual_seed(0)
    plan = autopar.evaluate(FunctionLM(), fast_cluster(2), autopar.Layout(
        dtype="fp32", **LAYOUTS[layout]), global_batch_size=4, seq_len=4)
    report = run_distributed(_rank, 2, plan, timeout_s=300)[0]
    assert report["ok"] and report["max_grad_diff"] < 1e-5, report
