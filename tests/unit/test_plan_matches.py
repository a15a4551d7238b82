"""``autopar.parallelize`` refuses a plan made for another model, locally and before any
collective (no process group exists in this test: the error must come first), instead of
training a wider model under the plan silently or failing a deeper one with a KeyError."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import autopar
from autopar.models import GPT, preset
from helpers import tiny_plan

CONFIG = preset("gpt-tiny")  # 2 layers, 4 heads, h = 32, V = 64, s = 16
SGD = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.fixture(scope="module")
def plan() -> autopar.Plan:
    return tiny_plan(2, 1)


def _gpt(**changes) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CONFIG, **changes))


def test_a_wider_model_is_refused_by_its_config(plan):
    with pytest.raises(ValueError, match=r"different config .*'n_embd': \(32, 64\)"):
        autopar.parallelize(_gpt(n_embd=64), plan=plan, optimizer=SGD)


def test_a_deeper_model_is_refused_by_its_graph(plan):
    no_config = dataclasses.replace(plan, model_config={})  # e.g. a model without .config
    with pytest.raises(ValueError, match=r"traced graph differs .* model nodes are not in the plan"):
        autopar.parallelize(_gpt(n_layer=3), plan=no_config, optimizer=SGD)
    with pytest.raises(ValueError, match=r"traced graph differs .* plan nodes are not in the model"):
        autopar.parallelize(_gpt(n_layer=1), plan=no_config, optimizer=SGD)


def test_the_model_the_plan_was_made_for_passes_the_check(plan):
    from autopar.recipe import check_plan_matches

    check_plan_matches(_gpt(), plan)  # raises nothing
    with pytest.raises(RuntimeError, match="torch.distributed to be initialised"):
        autopar.parallelize(_gpt(), plan=plan, optimizer=SGD)  # the next check: no group
