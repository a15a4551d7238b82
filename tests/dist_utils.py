"""Run a function on N local CPU processes joined in a gloo process group.

``run_distributed(fn, world_size, *args)`` is what multi-process tests call: each child
initialises gloo over TCP on 127.0.0.1, runs ``fn(rank, world_size, *args)`` and sends
its return value back; the parent returns them in rank order, re-raises the first
failure with that rank's traceback, and kills everything after ``timeout_s``. It is
:func:`autopar.runtime.launch.launch` with the tests' process-group timeout.
"""

from __future__ import annotations

from typing import Any, Callable

from autopar.runtime.launch import launch

PG_TIMEOUT_S = 60  # a collective that cannot complete fails the test within a minute


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    ``fn`` must be a module-level (picklable) function and return picklable values
    (tensors on the CPU). Returns the per-rank results in rank order.

    Raises:
        RuntimeError: a rank raised (message holds its traceback) or died.
        TimeoutError: not every rank finished within ``timeout_s`` seconds.
    """
    return launch(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=PG_TIMEOUT_S)
