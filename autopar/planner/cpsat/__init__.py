"""Step 4 of the flow: the CP-SAT model of one config.

* :mod:`~autopar.planner.cpsat.model`: ``ConfigModel`` (strategies, stage cuts, recompute,
  ZeRO stage and their memory and time rows) and ``template_map``, re-exported here;
* :mod:`~autopar.planner.cpsat.edges`: the edge transitions and the kept versions of
  tensors; :mod:`~autopar.planner.cpsat.terms`: the per-section terms, recompute counts,
  exposed data-parallel time and ordered makespans.

Imports the strategies and the costs of the planner, never the search.
"""

from autopar.planner.cpsat.model import *  # noqa: F401,F403  the model
from autopar.planner.cpsat.model import __all__  # noqa: F401
