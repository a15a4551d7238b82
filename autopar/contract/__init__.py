"""The plan contract: what every step of the flow agrees on, in one package.

* :mod:`~autopar.contract.plan`: ``Layout`` (a user's pins), ``Plan`` and ``Prediction`` (a
  priced layout, versioned JSON), the vocabularies (dtypes, recompute modes, ZeRO stages);
* :mod:`~autopar.contract.plan_check`: the one validator of a saved plan;
* :mod:`~autopar.contract.plan_memory`, :mod:`~autopar.contract.plan_replicated`: what a
  plan says about memory and the ops every TP rank runs whole;
* :mod:`~autopar.contract.placement`: placements and the strategy keys of ``Plan.placements``;
* :mod:`~autopar.contract.stages`: the layers of each pipeline chunk;
* :mod:`~autopar.contract.support`: what the runtime executes and the rules of a layout.

The planner writes it, the rewrite, the runtime, the report and the framework emitters read
it; it imports none of them (only :mod:`autopar.techniques` and :mod:`cost_models`).
"""
