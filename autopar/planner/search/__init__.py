"""Step 5 of the flow: the search over mesh shapes, micro-batch sizes and schedules.

* :mod:`~autopar.planner.search.branch_and_bound`: ``search`` (configs in order of a lower
  bound, pruned or solved by CP-SAT), ``SearchContext``, ``solve_config``, re-exported here;
* :mod:`~autopar.planner.search.configs`: the candidate configs of a layout and a runtime;
* :mod:`~autopar.planner.search.pruning`, :mod:`~autopar.planner.search.bounds`,
  :mod:`~autopar.planner.search.layer_bounds`: the lower bounds that skip configs;
* :mod:`~autopar.planner.search.outcome`: what a search proved, and its errors.

Imports the strategies, the costs and the CP-SAT model of the planner.
"""

from autopar.planner.search.branch_and_bound import *  # noqa: F401,F403  the search
from autopar.planner.search.branch_and_bound import __all__  # noqa: F401
