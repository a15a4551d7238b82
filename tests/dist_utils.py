"""Run a function on N local CPU processes joined in a gloo process group.

``run_distributed(fn, world_size, *args)`` is what multi-process tests call: each child
initialises gloo over TCP on 127.0.0.1, runs ``fn(rank, world_size, *args)`` and sends
its return value back; the parent returns them in rank order, re-raises the first
failure with that rank's traceback, and kills everything after ``timeout_s``.
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

import torch
import torch.distributed as dist


def _free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out: Any) -> None:
    """Child body: init gloo, run fn, put (rank, ok, pickled result or traceback) on ``out``."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=60),
        )
        result = fn(rank, world_size, *args)
        # Plain pickle (not the queue's shared-memory tensor pickler): the child may exit first.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Flush the result, then skip the interpreter's slow teardown of torch (seconds per
    # process on a loaded machine); nothing else is left to clean up in this child.
    out.close()
    out.join_thread()
    os._exit(0)


def _collect(procs: list, out: Any, world_size: int, timeout_s: float) -> dict[int, Any]:
    """Wait for every rank's message; raise on the first failure, a silent death or the deadline."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    while len(results) < world_size:
        try:
            rank, ok, payload = out.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s} s")
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        results[rank] = pickle.loads(payload)
    return results


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    ``fn`` must be a module-level (picklable) function and return picklable values
    (tensors on the CPU). Returns the per-rank results in rank order.

    Raises:
        RuntimeError: a rank raised (message holds its traceback) or died.
        TimeoutError: not every rank finished within ``timeout_s`` seconds.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        results = _collect(procs, out, world_size, timeout_s)
    except BaseException:
        for p in procs:  # the others may be blocked in a collective with the failed rank
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
