"""What ``parallelize`` refuses about a plan's expert parallelism, before any collective
(no process group is initialised here: a refusal that came later would be a RuntimeError
about the missing process group instead)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from autopar import recipe

pytest.importorskip("transformers")


@functools.lru_cache(maxsize=None)
def _mixtral_plan():
    """The tiny Mixtral (4 experts) at dp = 4, priced at ep = 1 (zero_stage 0)."""
    import autopar
    from benchmarks.hf_families import build_family, tiny_cluster

    return autopar.evaluate(build_family("mixtral", device="meta"), tiny_cluster(4),
                            autopar.Layout(tp=1, pp=1, dp=4, micro_batch_size=2, dtype="fp32"),
                            global_batch_size=8, seq_len=16, model_name="mixtral")


def _parallelize(model, plan):
    return recipe.parallelize(model, plan=plan, optimizer=torch.optim.SGD)


def test_ep_with_zero_above_0_is_refused_before_any_collective():
    from benchmarks.hf_families import build_family

    plan = dataclasses.replace(_mixtral_plan(), ep=2, zero_stage=1)
    with pytest.raises(ValueError, match=r"ep=2 with zero_stage=1.*use zero_stage in \[0\]"):
        _parallelize(build_family("mixtral"), plan)


def test_ep_on_a_model_without_experts_modules_is_refused_before_any_collective():
    import autopar
    from benchmarks.hf_families import build_family, tiny_cluster

    plan = autopar.evaluate(build_family("llama", device="meta"), tiny_cluster(4),
                            autopar.Layout(tp=1, pp=1, dp=4, micro_batch_size=2, dtype="fp32"),
                            global_batch_size=8, seq_len=16, model_name="llama")
    with pytest.raises(ValueError, match="no mixture-of-experts layer; use ep=1"):
        _parallelize(build_family("llama"), dataclasses.replace(plan, ep=2))
