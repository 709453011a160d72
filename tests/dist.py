"""Run a function on N gloo ranks in fresh processes, with a hard timeout.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, creates the default process
group (gloo, FileStore, loopback), calls ``fn(rank, world_size, *args)`` and returns the
results in rank order. When any rank fails, the others are killed and the failing rank's
traceback is raised; when the timeout passes, all are killed and TimeoutError names the ranks
still running. Functions must be importable (module level).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def _entry(fn: Callable[..., Any], rank: int, world: int, store_path: str, q: Any, args: tuple, backend: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
        result = fn(rank, world, *args)
        buffer = io.BytesIO()  # tensors by value: a queue would share them by file descriptor,
        torch.save(result, buffer)  # which breaks once this process exits
        q.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results in rank order."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store_path, q, args, backend), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    running = [r for r in range(world_size) if r not in results]
                    raise TimeoutError(f"ranks {running} still running after {timeout:.0f} s")
                try:
                    rank, status, value = q.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
                    continue
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r] for r in range(world_size)]
