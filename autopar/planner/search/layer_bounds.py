"""Least time and least kept bytes of one template layer, from small CP-SAT solves.

The search's step-time bounds (:mod:`autopar.planner.search.bounds`) need what no plan of a
Config can go below per layer. Summing each node's own least value is cheap but loose:
strategies that keep the fewest bytes at one node force gathered (larger) versions on its
neighbours' edges. Here the strategy-choice, boundary and edge rows of
:class:`~autopar.planner.cpsat.ConfigModel` alone (no pipeline, memory or objective rows)
are minimised for one quantity, so the optimum respects those couplings. Each answer is
CP-SAT's proven objective bound less every term's rounding, so it holds whatever the
solver's status.
"""

from __future__ import annotations

import math

from autopar.graph.annotate import TracedModel
from autopar.planner.costs.tables import CostTables
from autopar.planner.cpsat import ConfigModel
from autopar.planner.costs.step import KIB
from autopar.planner.strategies import NodeStrategies

__all__ = ["min_layer_time_s", "min_layer_kept_bytes"]


def _layer_model(traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                 cluster) -> ConfigModel:
    """The layer's strategy-choice, boundary and edge rows of :class:`ConfigModel`."""
    cm = ConfigModel(traced, strategies, tables, cluster)
    cm.units_per_second *= 100
    cm.add_strategy_choice()
    cm.add_boundaries()
    cm.add_edges()
    return cm


def _minimum(cm: ConfigModel, expr, slack: float, max_time_s: float) -> float:
    """CP-SAT's proven lower bound of ``expr`` (model units) less ``slack`` units, the
    most its rounding can add, at least 0."""
    cm.model.Minimize(expr)
    _, solver = cm.solve(max_time_s)
    return max(0.0, solver.BestObjectiveBound() - slack)


def min_layer_time_s(traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                     cluster, max_time_s: float = 1.0) -> float:
    """A lower bound (seconds) on one template layer's forward + backward, TP communication
    and Megatron's f included, under ``tables``' Config (no memory, so no recompute). The
    search multiplies it into a step-time bound that prunes configs before their full model
    is built. Times use 100 × the model's usual resolution, and every term's rounding (at
    most half a unit) is taken off."""
    cm = _layer_model(traced, strategies, tables, cluster)
    terms = len(cm.terms.terms["layer"]["fwd"]) + len(cm.terms.terms["layer"]["bwd"])
    units = _minimum(cm, cm.terms.expr("layer", "fwd") + cm.terms.expr("layer", "bwd"),
                     0.5 * terms, max_time_s)
    return units / cm.units_per_second


def min_layer_kept_bytes(traced: TracedModel, strategies: NodeStrategies, tables: CostTables,
                         cluster, max_time_s: float = 1.0) -> tuple[float, float]:
    """Lower bounds (bytes per micro-batch and GPU) on what one template layer keeps for
    backward under ``tables``' Config: without recompute (the model's "act": nodes' saved
    tensors and the kept versions of their inputs) and with selective recompute ("act"
    less "core_act", the attention core it drops). The model's memory terms are KiB
    rounded up; here "act" counts whole bytes rounded down and "core_act" the model's
    KiB, so each bound holds for the exact bytes and for the model's rows alike."""
    cm = _layer_model(traced, strategies, tables, cluster)  # one model, two objectives
    layer = cm.terms.terms["layer"]
    act = sum(math.floor(c * KIB) * v for c, v in layer["act"] if c)
    core = sum(math.ceil(c) * KIB * v for c, v in layer["core_act"] if c)
    return _minimum(cm, act, 0.0, max_time_s), _minimum(cm, act - core, 0.0, max_time_s)
