"""Step 3 of the flow: prices of one config, and of a decided plan.

* :mod:`~autopar.planner.costs.tables`: ``Config`` and the cost tables (seconds and bytes
  of every node strategy and edge transition of one micro-batch), with
  :mod:`~autopar.planner.costs.node_cost`, :mod:`~autopar.planner.costs.matmul_cost`,
  :mod:`~autopar.planner.costs.precision` and :mod:`~autopar.planner.costs.cache` (what
  the configs of one search share);
* :mod:`~autopar.planner.costs.step`, :mod:`~autopar.planner.costs.reserve`,
  :mod:`~autopar.planner.costs.comm_bytes`: pipelined step time, the memory reserve, the
  bytes each collective moves;
* :mod:`~autopar.planner.costs.predict`: the prediction of a decided plan, and
  :mod:`~autopar.planner.costs.decision`: ``Decision`` and its ``Plan``.

Imports only :mod:`autopar.planner.strategies` of the planner.
"""
