"""What a search shares between its configs gives the answers each config's own
computation gives (issue 34: planning DeepSeek-V3 on 2,048 GPUs in seconds, with the same
plan).

* A layer's least kept bytes (:func:`~autopar.planner.search.layer_bounds.min_layer_kept_bytes`,
  two CP-SAT solves) are solved once for the configs whose template nodes keep the same
  bytes, e.g. every EP degree of a MoE model; a node's price is shared over EP degrees
  except for the experts calls that ep prices. The bounds equal those of a fresh cache
  per config.
* The kept bytes of the order bounds solved ahead on two threads are the ones each bound
  would solve itself.
* The runner-ups a plan lists are chosen by the least step-time lower bounds with TP
  communication, computed only until the bound without it says no other can be nearer:
  the same ones, in the same order, as computing every bound.
* Solves whose inputs depend on the answers before them, started ahead of their turn
  (:func:`~autopar.planner.search.speculate.in_turn`), give the one-at-a-time loop's answers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest

from helpers import load_script

from autopar.contract.plan import Alternative, Layout
from autopar.contract.support import RUNTIME_SUPPORT
from autopar.graph.capture import trace_model
from autopar.planner.costs.cache import SearchCache
from autopar.planner.costs.tables import cost_tables
from autopar.planner.search import SearchContext, candidate_configs
from autopar.planner.search.branch_and_bound import _least_lower_bounds
from autopar.planner.search.speculate import in_turn
from autopar.planner.search.pruning import (order_bound_s, prefetch_order_bounds,
                                            step_lower_bound_s, strategies_for)
from cost_models.hardware import Cluster

pytest.importorskip("transformers")
families = load_script("benchmarks/hf_families.py")

SEQ, BATCH = 16, 32


@pytest.fixture(scope="module")
def problem():
    traced = trace_model(families.build_family("mixtral", device="meta"), SEQ)
    cluster = Cluster.dgx_a100(1)
    configs = candidate_configs(traced, cluster, BATCH, Layout(), RUNTIME_SUPPORT)
    assert len({c.ep for c in configs}) > 2  # EP degrees to share between
    return traced, cluster, configs


def _pricing_keys(configs):
    """One config per (tp, SP, ep, pp > 1) of micro-batch size 1: the keys the shared
    answers are stored under, with and without a pipeline."""
    out = {}
    for c in configs:
        if c.micro_batch_size == 1:
            out.setdefault((c.tp, c.sequence_parallel, c.micro_batch_size, c.ep, c.pp > 1), c)
    return list(out.values())


def test_shared_bounds_equal_a_fresh_cache_per_config(problem):
    traced, cluster, configs = problem
    shared = SearchCache()
    for cfg in _pricing_keys(configs):
        for comm in (False, True):
            alone = step_lower_bound_s(traced, cluster, cfg, SearchCache(), Layout(),
                                       RUNTIME_SUPPORT, float("inf"), comm=comm)
            assert step_lower_bound_s(traced, cluster, cfg, shared, Layout(), RUNTIME_SUPPORT,
                                      float("inf"), comm=comm) == alone
    entries = shared.entries()
    assert entries["layer_kept_bytes"] < entries["layer_pieces"]  # EP degrees shared a solve


def test_tables_shared_over_ep_equal_fresh_tables(problem):
    traced, cluster, configs = problem
    shared = SearchCache()
    for cfg in _pricing_keys(configs):
        strategies = strategies_for(traced, cfg.tp, cfg.sequence_parallel, shared)
        fresh = cost_tables(traced, strategies, cluster, cfg)
        assert cost_tables(traced, strategies, cluster, cfg, shared) == fresh


def test_order_bounds_prefetched_on_threads_equal_those_computed_in_turn(problem):
    traced, cluster, configs = problem
    configs = _pricing_keys(configs)
    prefetched, in_turn = SearchCache(), SearchCache()
    with ThreadPoolExecutor(2) as pool:
        prefetch_order_bounds(traced, cluster, configs, prefetched, Layout(), RUNTIME_SUPPORT,
                              pool)
    assert prefetched.entries()["layer_kept_bytes"] > 1
    for cfg in configs:
        assert order_bound_s(traced, cluster, cfg, prefetched, Layout(), RUNTIME_SUPPORT) == \
            order_bound_s(traced, cluster, cfg, in_turn, Layout(), RUNTIME_SUPPORT)


@pytest.fixture(scope="module")
def unpriced(problem):
    """Configs as a search leaves them for the runner-ups (every third one priced), a
    cutoff the search knows, and every unpriced config's bound, each computed."""
    traced, cluster, configs = problem
    alone = SearchCache()  # not the search's: every bound computed
    order = sorted(_pricing_keys(configs), key=lambda c: order_bound_s(
        traced, cluster, c, alone, Layout(), RUNTIME_SUPPORT))
    seen = [Alternative(layout=asdict(c), feasible=None if k % 3 else True)
            for k, c in enumerate(order)]
    known = {order[1]: 1e9}  # a cutoff CP-SAT could not beat
    every = {k: max(known.get(c, 0.0), step_lower_bound_s(
        traced, cluster, c, alone, Layout(), RUNTIME_SUPPORT, float("inf")))
        for k, c in enumerate(order) if seen[k].feasible is None}
    return seen, known, every


@pytest.mark.parametrize("count", [0, 1, 4, 1000])
def test_runner_ups_are_the_least_bounds_of_all(problem, unpriced, count):
    traced, cluster, _ = problem
    seen, known, every = unpriced
    ctx = SearchContext.of(traced, cluster, Layout(), RUNTIME_SUPPORT)
    lower = _least_lower_bounds(ctx, seen, known, count)
    chosen = sorted(lower, key=lambda k: (lower[k], k))[:count]
    assert chosen == sorted(every, key=every.get)[:count]
    assert all(lower[k] == every[k] for k in lower)
    assert count >= len(every) or len(lower) < len(every) or count == 0


@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_solves_ahead_of_their_turn_give_the_loop_in_turn(ahead):
    # inputs read the state the answers before them changed: the best so far, and a skip
    def run(speculate: bool) -> list:
        state = {"best": 100}
        log = []

        def inputs(item):
            return None if item % 5 == 4 else (state["best"], item % 3)

        def solve(item, args):
            return (item * 37 + args[0] * 3 + args[1]) % 101

        def use(item, args, out):
            log.append((item, args, out))
            state["best"] = min(state["best"], out)
        items = list(range(20))
        if speculate:
            with ThreadPoolExecutor(2) as pool:
                in_turn(items, inputs, solve, use, pool, ahead)
        else:
            for item in items:
                args = inputs(item)
                if args is not None:
                    use(item, args, solve(item, args))
        return log
    assert run(True) == run(False)
    assert len({args[0] for _, args, _ in run(False)}) > 2  # the inputs did change
