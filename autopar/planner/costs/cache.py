"""What the configs of one search share, priced once: :class:`SearchCache`.

A search visits hundreds of configs that differ only in pp, dp, m, the schedule or v; the
strategies of a TP size, the cost of the same op in every layer and the bounds of a
(tp, micro-batch size, dtype, attention, SP) do not depend on them. The cache holds each
kind of shared answer under its own method, keyed by exactly what the answer depends on,
so that a maintainer reads what is shared, and by what, in one place. Answers are computed
by the caller's ``compute`` (no pricing here) and only read afterwards: entries may be
shared between configs.

One cache belongs to one :class:`~autopar.planner.search.SearchContext` (one traced model,
one cluster); nothing is global.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from autopar.techniques.expert_parallel import experts_token_parallel

__all__ = ["SearchCache"]

T = TypeVar("T")


class SearchCache:
    """Answers shared by the configs of one search, one method per kind (module docstring).

    Every method takes the key the answer depends on and a ``compute()`` thunk that is
    called once per key; it returns the stored answer.
    """

    def __init__(self) -> None:
        self._kinds: dict[str, dict[Hashable, Any]] = {}

    def _get(self, kind: str, key: Hashable, compute: Callable[[], T]) -> T:
        table = self._kinds.setdefault(kind, {})
        if key not in table:
            table[key] = compute()
        return table[key]

    def entries(self) -> dict[str, int]:
        """Kind -> number of stored answers (what the search shared)."""
        return {kind: len(table) for kind, table in self._kinds.items()}

    def strategies(self, tp: int, sequence_parallel: bool, compute: Callable[[], T],
                   ep: int = 1) -> T:
        """The node strategies at (tp, sequence parallelism, experts on TP ranks' tokens)
        (:func:`~autopar.planner.strategies.node_strategies`)."""
        return self._get("strategies", (tp, sequence_parallel, experts_token_parallel(tp, ep)),
                         compute)

    def megatron_keys(self, tp: int, sequence_parallel: bool, compute: Callable[[], T],
                      ep: int = 1) -> T:
        """The strategy keys Megatron-LM's pattern allows per node at (tp, SP, experts on
        tokens) (:func:`~autopar.planner.strategies.megatron.allowed_strategies`)."""
        return self._get("megatron_keys",
                         (tp, sequence_parallel, experts_token_parallel(tp, ep)), compute)

    def pricing_rows(self, tp: int, sequence_parallel: bool, template_only: bool,
                     compute: Callable[[], T], ep: int = 1) -> T:
        """Per node, its pricing signature and its edges' (the cost tables' rows)."""
        return self._get("pricing_rows", (tp, sequence_parallel, template_only,
                                          experts_token_parallel(tp, ep)), compute)

    def tp_tables(self, key: tuple, compute: Callable[[], T]) -> T:
        """The cost tables without the pipeline's point-to-point time, per (tp, micro-batch
        size, activation bytes, attention, SP, template only)."""
        return self._get("tp_tables", key, compute)

    def node_costs(self, key: tuple, compute: Callable[[], T]) -> T:
        """One pricing problem's strategy costs, per (tp, SP, template only, node
        signature, micro-batch size, activation bytes, attention, ep: that of the config
        for an experts call, 1 for every other node, whose price ep does not change)."""
        return self._get("node_costs", key, compute)

    def edge_costs(self, key: tuple, compute: Callable[[], T]) -> T:
        """One edge's transition costs, per (tp, SP, template only, edge signature,
        micro-batch size, activation bytes)."""
        return self._get("edge_costs", key, compute)

    def tp_collective_s(self, nbytes: float, tp: int, compute: Callable[[], T]) -> T:
        """(all_reduce, reduce_scatter) seconds of ``nbytes`` over a TP group of ``tp``."""
        return self._get("tp_collective_s", (nbytes, tp), compute)

    def layer_compute_s(self, key: tuple, compute: Callable[[], T]) -> T:
        """The least compute seconds of a layer, per (tp, micro-batch size, dtype,
        attention, SP) (:func:`~autopar.planner.search.layer_bounds.min_layer_compute_s`)."""
        return self._get("layer_compute_s", key, compute)

    def layer_pieces(self, key: tuple, compute: Callable[[], T]) -> T:
        """A layer's least kept bytes and time pieces of the step bound, per the same key."""
        return self._get("layer_pieces", key, compute)

    def layer_kept_bytes(self, key: tuple, compute: Callable[[], T]) -> T:
        """A layer's least kept bytes without and with selective recompute
        (:func:`~autopar.planner.search.layer_bounds.min_layer_kept_bytes`), per (tp, SP,
        micro-batch size, activation bytes, attention, the template nodes' saved bytes):
        its CP-SAT model reads only the edges (priced per the first four) and those bytes,
        so configs whose nodes keep the same bytes (the EP degrees of a MoE model, which
        move times and parameters only) share one solve of the same model."""
        return self._get("layer_kept_bytes", key, compute)

    def layer_time_s(self, key: tuple, compute: Callable[[], T]) -> T:
        """The least seconds of a layer with its TP communication, per the same key."""
        return self._get("layer_time_s", key, compute)

    def memory_bounds(self, cfg: Hashable, compute: Callable[[], T]) -> T:
        """(memory lower bound, usable bytes) of one config."""
        return self._get("memory_bounds", cfg, compute)

    def total_params(self, compute: Callable[[], T]) -> T:
        """The model's parameter count (once per search)."""
        return self._get("total_params", (), compute)

    def expert_params(self, compute: Callable[[], T]) -> T:
        """The parameter elements of the model's experts calls (once per search)."""
        return self._get("expert_params", (), compute)

    def graph_totals(self, compute: Callable[[], T]) -> T:
        """The graph's output node and the model's matmul FLOPs per sequence (forward and
        backward), which every cost table reads (once per search)."""
        return self._get("graph_totals", (), compute)

    def graph_index(self, compute: Callable[[], T]) -> T:
        """Node name -> fx node of the traced graph (once per search)."""
        return self._get("graph_index", (), compute)
