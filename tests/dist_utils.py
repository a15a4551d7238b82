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


def _survivor_child(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
                    out: Any) -> None:
    """One rank of :func:`run_survivors`: init gloo, run ``fn``, put (rank, ok, pickled
    result or error text) on ``out``, exit without teardown (a peer may be dead)."""
    import os
    import pickle
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from autopar.runtime.launch import HOST

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://{HOST}:{port}",
                                timeout=timedelta(seconds=120))
        out.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the traceback
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


def run_survivors(fn: Callable[..., Any], world_size: int, *args: Any, expected: int,
                  timeout_s: float = 300) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes (forkserver) of which
    some are meant to die or hang (a fault-injection test): returns {rank: return value} of
    the ranks that returned, once ``expected`` of them have (or ``timeout_s`` passed); then
    every process still alive (a stopped one included) is killed. The world group's
    timeout is 120 s: ``fn`` gives the timeout under test to ``parallelize``.

    Raises RuntimeError when a rank raised (``fn`` returns what it wants to report)."""
    import multiprocessing as mp
    import pickle
    import queue
    import time

    from autopar.runtime.launch import PRELOAD, free_port

    # forked from launch's server, which imported torch and autopar once (a spawned rank
    # imports them anew: ~15 s for 4 ranks on 2 cores); a stopped or killed child is the
    # server's, killed here as under spawn
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_survivor_child, args=(r, world_size, port, fn, args, out),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < expected and time.monotonic() < deadline:
            try:
                rank, ok, payload = out.get(timeout=1)
            except queue.Empty:
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed: {payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    return results
