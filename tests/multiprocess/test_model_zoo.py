"""The model zoo's families, parallelized and verified against one process on real gloo
groups of 2 ranks (tp = 2 with sequence parallelism and selective recompute, and dp = 2):
equal within verify's tolerances. ``reports/model_zoo.md`` (benchmarks/model_zoo.py) has the
full table, pipeline layouts included."""

from __future__ import annotations

import pytest

from helpers import load_script

zoo = load_script("benchmarks/model_zoo.py")

PASSING = ["nanogpt", "gpt2", "gpt_neox", "llama", "mistral", "qwen2", "opt", "gemma", "phi3"]


@pytest.mark.parametrize("family", PASSING)
def test_family_verifies_at_tp2_with_sp_and_recompute(family):
    pytest.importorskip("transformers")
    assert zoo.verify_tiny(family, "tp2").startswith("ok")


# opt, gemma: nn.Embedding subclasses with their own forward, here run replicated
@pytest.mark.parametrize("family", ["gpt2", "llama", "opt", "gemma"])
def test_family_verifies_at_dp2(family):
    pytest.importorskip("transformers")
    assert zoo.verify_tiny(family, "dp2").startswith("ok")

