"""Techniques as records: one module per technique owns, for each of its values, the rule
(what it runs with), the price (the cost model's terms), the runner (what executes it), the
drawing (the report's picture) and the framework mapping (each target's name for it, or a
refusal). The cost model, planner, runtime, report and frameworks read the records
instead of comparing names.

* :mod:`autopar.techniques.pipeline_schedules`: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV.
* :mod:`autopar.techniques.zero_stages`: ZeRO-0 (replicated), ZeRO-1, ZeRO-2, ZeRO-3 (FSDP2).
* :mod:`autopar.techniques.recompute_modes`: none, selective (the attention core), full (the layer).
* :mod:`autopar.techniques.expert_parallel`: expert parallelism (ep) folded over TP and DP.
* :mod:`autopar.techniques.context_parallel`: context parallelism (cp), the head-tail sequence
  split and all-gather attention (its runner so far: the attention alone,
  :mod:`autopar.runtime.context_parallel`; the planner does not search cp yet).
"""
