"""Exposed communication time, and profiler ranges named after fullshard's collectives and units.

A collective is *exposed* while the thread that issued it is blocked in it: inside a synchronous
call, or in ``Handle.wait()`` of an asynchronous one. Communication that runs while the thread
computes (a prefetched all-gather, a reduce-scatter overlapping the next unit's backward) is
hidden and not counted. :func:`exposed_seconds` is the running total of this process in seconds;
the training jobs report its growth per step as ``comm_exposed_seconds`` and the rest of the
step as ``compute_seconds``.

While torch.profiler records, each blocking region is also a ``record_function`` range named
``fullshard::<op> <unit>`` (``fullshard::wait all_gather layers.1``), and :func:`open_range` /
:func:`close_range` mark a unit's forward and backward, so a trace shows which unit waited on
which collective.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.autograd.profiler as autograd_profiler

from fullshard import compat

F = TypeVar("F", bound=Callable[..., Any])

_inside = threading.local()
_lock = threading.Lock()
_total = 0.0


def exposed_seconds() -> float:
    """Seconds this process's threads have spent blocked in collectives so far (monotonic)."""
    return _total


def profiling() -> bool:
    """Whether torch.profiler (or the autograd profiler) is recording now."""
    return compat.profiler_enabled()


@contextlib.contextmanager
def blocked(name: Callable[[], str]) -> Iterator[None]:
    """Count the time inside as exposed communication (once: nested regions are not added
    again) and, while profiling, mark it as the range ``name()``."""
    global _total
    if getattr(_inside, "active", False):
        yield
        return
    _inside.active = True
    start = time.perf_counter()
    try:
        if profiling():
            with autograd_profiler.record_function(name()):
                yield
        else:
            yield
    finally:
        _inside.active = False
        with _lock:
            _total += time.perf_counter() - start


def blocking(op: str, unit: Callable[[], str | None]) -> Callable[[F], F]:
    """Decorator for a collective that may block its caller: see :func:`blocked`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with blocked(lambda: f"fullshard::{op} {unit() or ''}".rstrip()):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def open_range(name: str) -> Any:
    """Start the profiler range ``name`` if profiling (returns a token for :func:`close_range`,
    None otherwise)."""
    if not profiling():
        return None
    return autograd_profiler.record_function(name).__enter__()


def close_range(token: Any) -> None:
    """End a range started by :func:`open_range` (None: nothing to do)."""
    if token is not None:
        token.__exit__(None, None, None)
