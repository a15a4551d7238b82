"""Every family of the model zoo (benchmarks/model_zoo.py) is captured and planned on a
DGX-A100 node at tp = 2, and the solver's TP placements are Megatron's pattern: QKV and
MLP-in Linears split by columns, attention-out and MLP-out by rows (Shoeybi et al. 2019,
Fig. 3). Wide instances (h = 1024, s = 512) on the meta device: a few seconds each."""

from __future__ import annotations

import pytest

from helpers import load_script

zoo = load_script("benchmarks/model_zoo.py")


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_solver_rediscovers_megatron_pattern(family):
    if family not in ("autopar-gpt", "nanogpt"):
        pytest.importorskip("transformers")
    result = zoo.plan_wide(family)
    assert result["linears"] >= 8  # 2 layers, at least qkv-or-fused + out + mlp in/out each
    assert result["broken"] == []
