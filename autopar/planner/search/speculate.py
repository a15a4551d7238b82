"""Solves run in turn, each with inputs that depend on the answers before it, computed on
threads ahead of their turn without changing any answer.

The search solves the configs CP-SAT stopped at its time limit once more, in visit order,
each with the best plan found so far as its cutoff and the latest plan of its kind as its
hint (:func:`~autopar.planner.search.branch_and_bound.search`), so each solve's inputs
depend on the ones before it. :func:`in_turn` starts the next ones early with the inputs
they would have now; one whose inputs have changed when its turn comes (a solve before it
found a better plan) is solved again with the new ones. Every answer used is the solve of
exactly the inputs the one-at-a-time loop would give it: the result is that loop's,
only sooner when the inputs do not change (CP-SAT releases the GIL while it solves).
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Callable, Sequence, TypeVar

__all__ = ["in_turn"]

T = TypeVar("T")


def in_turn(items: Sequence[T], inputs: Callable[[T], object | None],
            solve: Callable[[T, object], object], use: Callable[[T, object, object], None],
            pool: Executor, ahead: int) -> None:
    """The loop ``for item in items: args = inputs(item); if args is not None:
    use(item, args, solve(item, args))``, with the solves of the next ``ahead`` items
    (itself included) submitted to ``pool`` under the present ``inputs``, and submitted
    again when its turn comes with other inputs (compared with ``==``). ``inputs`` may
    read what ``use`` changed; ``solve`` must be a function of its arguments only.
    A stale solve still runs to its end on its thread, unused."""
    pending: dict[int, tuple[object, Future]] = {}
    for k, item in enumerate(items):
        for j in range(k, min(k + max(ahead, 1), len(items))):
            args = inputs(items[j])
            if args is not None and (j not in pending or pending[j][0] != args):
                pending[j] = (args, pool.submit(solve, items[j], args))
        args = inputs(item)
        if args is not None:  # pending[k] holds the solve of exactly these inputs
            use(item, args, pending.pop(k)[1].result())
