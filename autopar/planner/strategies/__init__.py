"""Step 2 of the flow: the tensor-parallel strategies each traced node may take.

* :mod:`~autopar.planner.strategies.nodes`: the vocabulary (``Strategy``, ``node_strategies``,
  the transitions between placements, ``decode_placements``), re-exported here;
* :mod:`~autopar.planner.strategies.aten`: the strategies of aten ops by their semantics;
* :mod:`~autopar.planner.strategies.megatron`: Megatron-LM's pattern as placements (hand
  layouts, the Megatron-LM and torchtitan targets);
* :mod:`~autopar.planner.strategies.replicated`: the ops a plan's TP ranks run whole.

Imports nothing else of the planner: the cost tables, the CP-SAT model and the search build
on it, and the rewrite reads its vocabulary to decode a plan's keys.
"""

from autopar.planner.strategies.nodes import *  # noqa: F401,F403  the vocabulary
from autopar.planner.strategies.nodes import __all__  # noqa: F401
