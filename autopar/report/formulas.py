"""The published closed forms the cost model reproduces, as data for the plan report.

``FORMULAS_MARKDOWN`` is the Markdown that :func:`autopar.oracle.symbolic.formulas_markdown`
prints: one row per quantity (activation bytes per layer in bytes, model FLOPs per step,
model-state bytes under ZeRO), its closed form, its source (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models"; Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters"; Rajbhandari et al. 2020,
"ZeRO") and the test that checks it. It is checked in rather than computed so the report
imports neither sympy nor the oracle; ``tests/unit/test_symbolic.py`` asserts the two are equal,
so the table cannot drift from the oracle.
"""

__all__ = ["FORMULAS_MARKDOWN"]

FORMULAS_MARKDOWN = """\
### Closed forms the cost model reproduces

b micro-batch, s sequence, h hidden, a heads, t tensor-parallel size, B global batch, L layers, V vocabulary; bytes assume 16-bit activations and 1-byte dropout masks. Checked in `tests/unit/test_symbolic.py` (`autopar.oracle.symbolic`).

| quantity | closed form | source | check |
|---|---|---|---|
| activation bytes per layer, no parallelism | s·b·h·(34 + 5·a·s/h) | Korthikanti et al. 2022, Table 2 | derived from the traced graph, `sympy.simplify(derived - closed) == 0` |
| activation bytes per layer, tensor parallel | s·b·h·(10 + 24/t + 5·a·s/(h·t)) | Korthikanti et al. 2022, Table 2 | derived (placements from `autopar.plan` at t = 8, t symbolic) |
| same, selective recompute | 34·s·b·h | Korthikanti et al. 2022, section 5 | derived |
| same, tensor parallel + selective recompute | s·b·h·(10 + 24/t) | Korthikanti et al. 2022, Table 2 without the 5as/(ht) term | derived |
| same, full recompute (the layer input) | 2·s·b·h | Korthikanti et al. 2022, section 4.3 | derived |
| same, tensor + sequence parallel (reference; not priced yet) | s·b·h·(34/t + 5·a·s/(h·t)) | Korthikanti et al. 2022, Table 2 | not derived: sequence parallelism is not priced yet |
| same, tensor + sequence parallel + selective (reference; not priced yet) | 34·s·b·h/t | Korthikanti et al. 2022, Table 2 | not derived: sequence parallelism is not priced yet |
| model FLOPs per step, full recompute | 96·B·s·L·h²·(1 + s/(6·h) + V/(16·L·h)) | Narayanan et al. 2021, eq. (3) | derived, and equal to the traced count for GPT configs exactly |
| model FLOPs per step, no recompute (MFU numerator) | 72·B·s·L·h²·(1 + s/(6·h) + V/(12·L·h)) | Korthikanti et al. 2022, Appendix A | derived (72·(eq. 3 bracket) would undercount the logits by 1.5·B·s·h·V) |
| model states, 7.5B parameters, d = 64 (ZeRO 0/1/2/3) | 120 / 31.4 / 16.6 / 1.9 GB | Rajbhandari et al. 2020, Fig. 1 | `tests/unit/test_cost_models.py::test_zero_paper_figures` |
"""
