"""An in-flight collective (:class:`Handle`) and how its wait ends.

A Handle wraps torch Work objects (or other Handles), completes the flight recorder's entry and
runs the collective's local epilogue when waited. On gloo, while the watchdog runs, the wait goes
in slices of 0.1 s (``Work.wait(timeout)`` leaves the work running when a slice ends), so the main
thread raises the watchdog's error (a timeout, another rank's divergence) instead of blocking in
C++ until gloo's own timeout. A backend failure is raised again naming the collective and the
ranks that exited (:func:`explained`).
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from fullshard.comm import diagnosis, exposed_comm, peers, watchdog
from fullshard.comm.flight_recorder import RECORDER, Entry
from fullshard.comm.peers import CollectiveError, CollectiveFailed

F = TypeVar("F", bound=Callable[..., Any])
_SLICE = datetime.timedelta(seconds=0.1)


class Handle:
    """An in-flight collective. ``wait()`` blocks until it is done and runs its local epilogue.

    ``work`` is one torch Work (or Handle), a list of them (waited in order), or None.
    """

    def __init__(
        self, work: Any, epilogue: Callable[[], Any] | None = None, entry: Entry | None = None, sliced: bool = False
    ) -> None:
        self._work = work
        self._epilogue = epilogue
        self._done = False
        self._sliced = sliced  # a gloo work: wait in slices while the watchdog runs
        self._entry = entry  # the flight recorder's entry, completed by wait()
        if entry is not None:
            entry.probe = self.is_completed

    def wait(self) -> None:
        with exposed_comm.blocked(self._label):
            try:
                self._wait()
            except RuntimeError as e:
                _explain(e)

    def _label(self) -> str:
        """The profiler range of the wait: ``fullshard::wait <op> <unit>``."""
        works = self._work if isinstance(self._work, list) else [self._work]
        inner = [w._entry for w in works if isinstance(w, Handle) and w._entry is not None]
        e = self._entry or (inner[0] if inner else None)
        return f"fullshard::wait {e.op} {e.unit or ''}".rstrip() if e else "fullshard::wait"

    def _wait(self) -> None:
        if self._done:
            return
        for w in self._work if isinstance(self._work, list) else [self._work]:
            if isinstance(w, Handle):
                w.wait()
            elif w is not None:
                _wait_work(w, self._sliced)
        RECORDER.complete(self._entry)
        if self._epilogue is not None:
            self._epilogue()
        self._done = True

    def is_completed(self) -> bool:
        """Whether the communication has finished (without waiting)."""
        works = self._work if isinstance(self._work, list) else [self._work]
        return self._done or all(w is None or w.is_completed() for w in works)


def _wait_work(work: Any, sliced: bool) -> None:
    """``work.wait()``; on gloo with the watchdog running, in slices of :data:`_SLICE`, raising
    the watchdog's error (a timeout, another rank's divergence) between them."""
    if not sliced or watchdog.ACTIVE is None:
        work.wait()
        return
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            # A slice that ran out leaves the work running; but it may have finished between the
            # slice's timeout and this check: wait() then returns if it succeeded and raises
            # the work's own error if it failed (re-raising the slice's "Operation timed out!"
            # here failed healthy collectives under load: the MNIST demo at epoch 8).
            if work.is_completed():
                work.wait()
                return
        peers.raise_stop()  # outside the except: the slice's "timed out" is no part of the story


def explained(fn: F) -> F:
    """Re-raise a backend failure (a peer's connection closed) naming the collective, its unit
    and phase, and the ranks that exited."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            _explain(e)

    return inner  # type: ignore[return-value]


def _explain(e: RuntimeError) -> NoReturn:
    """Raise ``e`` again: as the watchdog's error if it has one (the other rank found a
    divergence, or a timeout, and exited), else as a CollectiveFailed naming the pending
    collective and the ranks that exited, if there is one."""
    pending = RECORDER.oldest_pending()
    if pending is None or isinstance(e, CollectiveError):
        raise e
    RECORDER.complete(pending, "failed")
    dog = watchdog.ACTIVE
    channel = watchdog.GUARD.channel if dog is not None and watchdog.GUARD is not None else None
    rank = channel.rank if channel is not None else _this_rank()
    text = diagnosis.failed(channel, rank, pending, e)
    if peers.STOP is not None:
        peers.RAISED = True
        raise peers.STOP from e
    raise CollectiveFailed(text) from e


def _this_rank() -> int:
    """This process's rank in the default group (started without a launcher, RANK may be unset),
    or RANK's value, or -1 when neither is known."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "-1"))
