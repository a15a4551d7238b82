"""The technique matrix's space, without processes: the matrix (helpers.combinations, run by
tests/multiprocess/test_matrix.py) covers every value autopar.contract.support.RUNTIME_SUPPORT declares,
and every plan the solver emits passes the runtime's own executability check."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import GPT
from autopar.contract.support import RUNTIME_SUPPORT
from helpers import MATRIX_FACTORS, SHAPES_4, combinations, pairwise


def test_matrix_covers_the_runtime_support():
    """The matrix is the runtime's declared space: every declared value appears."""
    seen = [c for shape in SHAPES_4 for c in combinations(*shape)]
    for field, values in (("schedule", RUNTIME_SUPPORT.schedules),
                          ("zero_stage", RUNTIME_SUPPORT.zero_stages),
                          ("recompute", RUNTIME_SUPPORT.recompute),
                          ("sequence_parallel", RUNTIME_SUPPORT.sequence_parallel),
                          ("virtual_stages", RUNTIME_SUPPORT.virtual_stages)):
        assert {c[field] for c in seen} == set(values), field


@pytest.mark.parametrize("shape", SHAPES_4, ids=lambda s: "tp%d-pp%d-dp%d" % s)
def test_the_trained_matrix_covers_every_pair_of_techniques(shape):
    """tests/multiprocess/test_matrix.py trains helpers.pairwise's subset: every two values
    of two factors (the optimizer among them) that occur together in the full product
    occur together in a chosen case, and the subset is smaller."""
    factors = MATRIX_FACTORS + ("opt",)
    cases = [dict(c, opt=o) for c in combinations(*shape) for o in ("sgd", "adamw")]
    chosen = pairwise(cases, factors)
    assert all(c in cases for c in chosen)
    for f, g in [(f, g) for i, f in enumerate(factors) for g in factors[i + 1:]]:
        assert {(c[f], c[g]) for c in chosen} == {(c[f], c[g]) for c in cases}, (f, g)
    assert len(chosen) < len(cases)


@pytest.mark.parametrize("model_name,nodes,batch,layout", [
    ("gpt-1.3b", 1, 512, {}),
    ("gpt-1.3b", 2, 512, {"pp": 2}),
    ("gpt-1.3b", 1, 64, {"tp": 2, "sequence_parallel": True, "dtype": "bf16"}),
])
def test_every_plan_the_solver_emits_is_executable(model_name, nodes, batch, layout):
    """The solver reads RUNTIME_SUPPORT, so its plans (and the alternatives it reports)
    pass the runtime's own check, whatever the model, cluster and pinned fields."""
    from autopar.contract.support import check_executable
    from autopar.models import preset

    with torch.device("meta"):
        meta = GPT(preset(model_name))
    plan = autopar.plan(meta, autopar.Cluster.dgx_a100(nodes), global_batch_size=batch,
                        seq_len=2048, layout=autopar.Layout(**layout))
    check_executable(plan)
    for field, value in layout.items():
        assert getattr(plan, field) == value, (field, plan.layout())
    for alt in plan.alternatives:
        cfg = alt.layout
        if cfg.get("schedule") is not None:
            assert cfg["schedule"] in RUNTIME_SUPPORT.schedules, alt
