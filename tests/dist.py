"""Run a function on N gloo ranks in worker processes, with a hard timeout.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on ``world_size``
ranks of a default process group (gloo, FileStore, loopback) and returns the results in rank
order. When any rank fails, all ranks are killed and the failing rank's traceback is raised;
when the timeout passes, all are killed and TimeoutError names the ranks still running.
Functions must be importable (module level).

Ranks are kept between calls, one set per world size (each spawned rank costs seconds of
imports on this machine, and the suite runs a few hundred calls): a kept rank restores the
environment variables, default dtype, grad mode, thread count and RNG seed before each call,
and a set that failed or timed out is killed, never reused. A call made while this process's
environment differs from the one the kept ranks started with (under ``monkeypatch.setenv``, or
after torch's elastic launcher added its variables) closes them and starts a new set in this
environment, so variables read at process start hold. ``fresh=True`` runs in new processes
that leave after the call: for measurements of a whole process such as peak RSS.

A kept rank also undoes what a call left in the process: attributes of the modules in
``PATCHABLE`` (torch.distributed's collectives, fullshard's collectives) are put back as they
were before the call, and fullshard's process-wide state is reset (:func:`reset_fullshard`: the
buffer pool, the flight recorder, the watchdog's settings, the probes, cached group facts,
use_in_torch bindings, warn-once flags). Tests patch with :func:`patched`, which restores too.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

_SEED = 1234  # every call starts from this default-generator seed (torch seeds new processes at random)
_VOLATILE = ("PYTEST_CURRENT_TEST",)  # pytest rewrites it for every test phase: never a reason for fresh ranks


# Modules whose attributes tests replace (collectives, tunables), restored after every call: in
# torch's, only functions and classes (its own globals, such as c10d's count of groups created,
# move on legitimately); in fullshard's, every attribute (none is rebound at run time).
PATCHABLE = {
    "torch.distributed": "callables",
    "torch.distributed.distributed_c10d": "callables",
    "fullshard.comm.collectives": "all",
    "fullshard.engine.layout": "all",
}


@contextlib.contextmanager
def patched(owner: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``owner`` (a module, a class) for a ``with`` block; the old values come
    back when it ends, also when it raises."""
    missing = object()
    saved = {name: getattr(owner, name, missing) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def _snapshot() -> dict[str, dict[str, Any]]:
    """The attributes of the loaded modules in ``PATCHABLE``."""
    return {
        name: {k: v for k, v in vars(sys.modules[name]).items() if kind == "all" or callable(v)}
        for name, kind in PATCHABLE.items()
        if name in sys.modules
    }


def _restore(snapshot: dict[str, dict[str, Any]]) -> None:
    """Put back the attributes ``snapshot`` saw, where replaced or removed. Names added are left:
    importing a submodule adds its name to the package, and the import system never adds it again."""
    for name, before in snapshot.items():
        namespace = vars(sys.modules[name])
        for key, value in before.items():
            if key not in namespace or namespace[key] is not value:
                namespace[key] = value


# fullshard's process-wide state and the function that resets each (module, function name).
_RESETS = (
    ("fullshard.comm.buffers", "POOL.clear"),
    ("fullshard.comm.flight_recorder", "reset"),
    ("fullshard.comm.watchdog", "reset"),
    ("fullshard.probes", "reset"),
    ("fullshard.comm.collectives", "clear_caches"),
    ("fullshard.comm.quantized", "reset_generators"),
    ("fullshard.frontend.torch_names", "reset"),
    ("fullshard.engine.build", "reset_warnings"),
    ("fullshard.engine.reduce_order", "forget_seen_roots"),
)


def reset_fullshard() -> None:
    """Reset fullshard's process-wide state in this process (modules not loaded are skipped).

    Kept on purpose: the hybrid-sharding groups and device meshes cached per process group (the
    kept ranks' default group lives across calls, and re-creating groups every call would leak
    gloo's threads), and the FSDP<Cls> classes fully_shard made.
    """
    for module_name, function in _RESETS:
        if module_name in sys.modules:
            target: Any = importlib.import_module(module_name)
            for part in function.split("."):
                target = getattr(target, part)
            target()


def _environment() -> dict[str, str]:
    """This process's environment as kept ranks compare it (pytest's per-test marker left out)."""
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE}


def _setup(rank: int, world: int, store_path: str, backend: str) -> None:
    import datetime
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack (captured stderr)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))


def _call(fn: Callable[..., Any], rank: int, world: int, args: tuple) -> tuple[str, Any]:
    """Run one call from a clean slate; ("ok", pickled result) or ("error", traceback)."""
    env = dict(os.environ)
    modules = _snapshot()
    torch.manual_seed(_SEED)
    try:
        result = fn(rank, world, *args)
        buffer = io.BytesIO()  # tensors by value: a queue would share them by file descriptor,
        torch.save(result, buffer)  # which breaks once this process exits
        return "ok", buffer.getvalue()
    except BaseException:
        return "error", traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        _restore(modules)
        reset_fullshard()


def _entry(fn: Callable[..., Any], rank: int, world: int, store_path: str, q: Any, args: tuple, backend: str) -> None:
    """A fresh rank: set up, run ``fn`` once, leave."""
    import torch.distributed as dist

    try:
        _setup(rank, world, store_path, backend)
        q.put((rank, *_call(fn, rank, world, args)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _kept(rank: int, world: int, store_path: str, inbox: Any, q: Any) -> None:
    """A kept rank: set up once, then run each ``(fn, args)`` from ``inbox`` until None."""
    try:
        _setup(rank, world, store_path, "gloo")
        for name in PATCHABLE:  # loaded before the first call, so that each call's snapshot holds them
            importlib.import_module(name)
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        return
    parent = os.getppid()
    while os.getppid() == parent:  # a pytest worker may leave by os._exit, without atexit
        try:
            job = inbox.get(timeout=1.0)
        except queue.Empty:
            continue
        if job is None:
            return
        fn, args = job
        q.put((rank, *_call(fn, rank, world, args)))


class _Ranks:
    """``world`` processes and their queues: kept ranks (with inboxes) or one call's fresh ranks."""

    def __init__(self, world: int, fn: Callable[..., Any] | None, args: tuple, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.q = world, ctx.Queue()
        self.tmp = tempfile.TemporaryDirectory()
        store = os.path.join(self.tmp.name, "store")
        self.env = _environment()
        self.inboxes = [ctx.Queue() for _ in range(world)] if fn is None else []
        if fn is None:
            targets = [(_kept, (r, world, store, self.inboxes[r], self.q)) for r in range(world)]
        else:
            targets = [(_entry, (fn, r, world, store, self.q, args, backend)) for r in range(world)]
        self.procs = [ctx.Process(target=t, args=a, daemon=True) for t, a in targets]
        for p in self.procs:
            p.start()

    def collect(self, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                running = [r for r in range(self.world) if r not in results]
                raise TimeoutError(f"ranks {running} still running after {timeout:.0f} s")
            try:
                rank, status, value = self.q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    codes = [self.procs[r].exitcode for r in dead]
                    raise RuntimeError(f"ranks {dead} died with exit codes {codes}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}{self._deaths(rank)}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        return [results[r] for r in range(self.world)]

    def _deaths(self, failed: int, wait: float = 1.0) -> str:
        """The other ranks whose process ended within ``wait`` seconds (s) of ``failed``'s
        error, with how: a peer that crashed (a signal such as SIGSEGV) makes the survivors
        report only "Connection reset by peer", and a kept rank never exits on its own."""
        import signal

        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            time.sleep(0.1)
        ended = []
        for r, p in enumerate(self.procs):
            code = p.exitcode
            if r != failed and code is not None:
                how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
                ended.append(f"rank {r} ended ({how})")
        return "\n(" + "; ".join(ended) + ")" if ended else ""

    def close(self, kill: bool) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            if kill:
                p.kill()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self.tmp.cleanup()


_KEPT: dict[int, _Ranks] = {}


@atexit.register
def _close_kept() -> None:
    while _KEPT:
        _KEPT.popitem()[1].close(kill=False)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240,
    backend: str = "gloo",
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results in rank order."""
    kept = _KEPT.get(world_size)
    if kept is not None and kept.env != _environment() and not fresh and backend == "gloo":
        del _KEPT[world_size]  # started under another environment: a new set starts under this one
        kept.close(kill=False)
        kept = None
    if fresh or backend != "gloo":
        ranks = _Ranks(world_size, fn, args, backend)
        try:
            return ranks.collect(timeout)
        finally:
            ranks.close(kill=False)
    if kept is None:
        kept = _KEPT[world_size] = _Ranks(world_size, None, (), backend)
    for box in kept.inboxes:
        box.put((fn, args))
    try:
        return kept.collect(timeout)
    except BaseException:
        del _KEPT[world_size]
        kept.close(kill=True)
        raise
