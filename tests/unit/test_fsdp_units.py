"""ZeRO-3 through FSDP2 (``autopar.runtime.fsdp``) without processes: units are per layer,
and a model not in float32 (no master weights) or pp > 1 is refused (the padded multi-process runs:
tests/multiprocess/test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.graph.capture import trace_model
from autopar.runtime.fsdp import FullyShardedOptimizer, layer_units
from autopar.contract.support import RUNTIME_SUPPORT
from helpers import ODD, seeded_gpt

SEQ = 16


def _odd_model():
    return seeded_gpt(ODD)


def test_layer_units_group_rewritten_modules_by_layer():
    traced = trace_model(_odd_model(), SEQ)
    from autopar.rewrite.pipeline import annotate_chunks

    annotate_chunks(traced, [[0, ODD.n_layer]])
    units, rest = layer_units(traced.gm)
    assert len(units) == ODD.n_layer
    names = {id(m): n for n, m in traced.gm.named_modules()}
    assert all(names[id(m)].startswith(f"transformer.h.{l}.") for l, u in enumerate(units) for m in u)
    assert {names[id(m)] for m in rest} == {"transformer.wte", "transformer.wpe",
                                            "transformer.ln_f", "lm_head"}


def test_zero3_needs_fp32_master_weights_and_pp1():
    with pytest.raises(ValueError, match="keep the model in float32"):
        FullyShardedOptimizer(torch.fx.symbolic_trace(nn.Linear(2, 2).bfloat16()),
                              torch.optim.SGD, dp_mesh=None)
    assert 3 in RUNTIME_SUPPORT.zero_stages_for(1)
    assert 3 not in RUNTIME_SUPPORT.zero_stages_for(2)
