"""Run a function on N local CPU processes joined in a gloo process group.

``launch(fn, world_size, *args)`` is the one local launcher of autopar: the multi-process
tests, ``autopar verify``, ``autopar calibrate`` and ``examples/quickstart.py`` use it.
It

1. picks a free TCP port on 127.0.0.1 and starts ``world_size`` processes with the
   ``forkserver`` start method: each is forked from a server process that imported torch
   and autopar once (:data:`PRELOAD`), so no state is inherited from the parent (the server
   is a fresh interpreter; the parent's ``sys.path``, working directory and main module are
   set up in each child as under ``spawn``; its environment is the server's, taken when
   the first launch started it), and a rank starts in a fraction of a second;
2. in each, sets one torch thread and initialises a gloo process group with a timeout
   (``pg_timeout_s``), so that a collective that can never complete fails within that
   time instead of torch's default 30 minutes;
3. runs ``fn(rank, world_size, *args)`` and sends its return value back (pickled), or the
   exception with that rank's traceback;
4. returns the values in rank order, or raises on the first failure: RuntimeError naming
   the rank (its traceback after the first line of the message) when a rank raised or
   died, TimeoutError naming the ranks still running after ``timeout_s`` wall seconds.
   Every process still alive is killed before the error propagates (the others may be
   blocked in a collective with the failed rank).

Under ``torchrun`` nothing needs launching: call the function in the processes it started.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["launch", "free_port"]

HOST = "127.0.0.1"
DEFAULT_PG_TIMEOUT_S = 60.0
PRELOAD = ("torch", "torch.distributed", "autopar", "autopar.recipe")
"""Modules the fork server imports once, so that a rank starts by a fork instead of
importing torch anew (on 2 cores: 4 ranks in about 0.5 s instead of 15 s). The runtime
(``autopar.recipe``, which imports torch's pipelining and with it torch._dynamo: about 1.6 s
of one core, 3 to 6 s per rank when 4 ranks import it at once on 2 cores) is among them."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, pg_timeout_s: float, fn: Callable[..., Any],
           args: tuple, out: Any) -> None:
    """One rank: init gloo, run ``fn``, put (rank, ok, pickled result or error text) on ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://{HOST}:{port}",
                                timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args)
        # plain pickle, not the queue's shared-memory tensor pickler: the child exits first
        out.put((rank, True, pickle.dumps(result)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the traceback
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # flush the message, then skip the interpreter's slow teardown of torch (seconds per
    # process on a loaded machine); nothing else is left to clean up in this child
    out.close()
    out.join_thread()
    os._exit(0)


def _collect(procs: list, out: Any, timeout_s: float) -> dict[int, Any]:
    """Every rank's result; raises on the first failure, a silent death or the deadline."""
    world_size, deadline = len(procs), time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    while len(results) < world_size:
        try:
            rank, ok, payload = out.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                                   ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:g} s; a rank "
                                   "may wait in a collective the others never reach, or the host "
                                   "is overloaded (raise the timeout)") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed: {payload}")
        results[rank] = pickle.loads(payload)
    return results


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
           pg_timeout_s: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    fn: a module-level (picklable) function; its return value must be picklable (tensors
        on the CPU). ``args`` are pickled to every process.
    timeout_s: wall seconds for the whole run, start-up included; then every process is
        killed.
    pg_timeout_s: the process group's timeout, seconds (default min(60, timeout_s)).
    Returns the per-rank return values in rank order.

    Raises:
        ValueError: world_size < 1.
        RuntimeError: a rank raised (message: "rank R failed: Type: message", then its
            traceback) or died without a word (its exit code).
        TimeoutError: not every rank finished within ``timeout_s``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if pg_timeout_s is None:
        pg_timeout_s = min(DEFAULT_PG_TIMEOUT_S, timeout_s)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # effective until the server first starts
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, pg_timeout_s, fn, args, out),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        results = _collect(procs, out, timeout_s)
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
