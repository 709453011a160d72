"""A per-rank flight recorder of every collective fullshard issues.

:mod:`fullshard.comm.collectives` records each call here as an :class:`Entry` (process group,
per-group sequence number, op, dtype, bytes, the FSDP unit and the phase it was issued for, the
training step) when it is issued, and marks it completed when its wait returns. The newest
``capacity`` entries are kept in a ring (``FULLSHARD_FLIGHT_RECORDER_SIZE``, default 4096; 0
turns recording off). The engine says which unit and phase it works for with :func:`at`; the
jobs (or a user) set the step with :func:`set_step`, otherwise it counts root forwards.

The watchdog (:mod:`fullshard.comm.watchdog`) reads it to say where a stuck rank waits, the
divergence check (:mod:`fullshard.comm.divergence`) to compare collectives across ranks, and
:func:`dump` writes it as JSON:

.. code-block:: text

    {"format": "fullshard-flight-recorder", "version": 1, "rank": 0, "world_size": 2,
     "pid": 1234, "dumped_at": 1764000000.0,             # seconds since the epoch
     "entries": [{"group": "0,1", "seq": 17, "op": "all_gather", "dtype": "torch.float32",
                  "numel": 1024, "nbytes": 4096, "unit": "layers.1", "phase": "forward",
                  "step": 3, "state": "completed", "issued_at": ..., "completed_at": ...}]}

``group`` is the group's global ranks, comma-separated; ``seq`` counts that group's
collectives on this rank from 1, so equal (group, seq) on two ranks are the same collective;
``nbytes`` is the bytes this rank sends; ``state`` is "issued" (pending), "completed", "failed"
(the backend raised) or "diverged" (another rank issued a different collective #``seq``: never
run); times are seconds since the epoch. The format is
fullshard's own: torch's Flight Recorder analyzer (``torchfrtrace``) reads pickled NCCL traces
and does not read it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from fullshard.comm import exposed_comm

F = TypeVar("F", bound=Callable[..., Any])

# The phase of the all-gather that compares a unit's new requires_grad flags across ranks (issued
# only by ranks whose flags changed; the divergence check's sentence names it).
REQUIRES_GRAD_CHECK = "requires_grad check"


@dataclasses.dataclass(slots=True)
class Entry:
    """One collective on this rank. Times are seconds since the epoch; ``nbytes`` is bytes sent."""

    group: str
    seq: int
    op: str
    dtype: str
    numel: int
    nbytes: int
    unit: str | None
    phase: str | None
    step: int
    state: str = "issued"
    issued_at: float = 0.0
    completed_at: float | None = None
    probe: Any = dataclasses.field(default=None, repr=False, compare=False)  # () -> finished?

    def identity(self) -> tuple[str, str, int, str | None, str | None]:
        """What must match on every rank for the same collective: op, dtype, element count, unit
        and phase (the step and the times may differ)."""
        return (self.op, self.dtype, self.numel, self.unit, self.phase)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "probe"}

    def describe(self) -> str:
        """``all_gather #17 of group [0,1] (4096 bytes, unit 'layers.1', forward, step 3)``."""
        where = ", ".join(
            x for x in (f"unit {self.unit!r}" if self.unit else "", self.phase or "", f"step {self.step}") if x
        )
        return f"{self.op} #{self.seq} of group [{self.group}] ({self.nbytes} bytes, {where})"


@dataclasses.dataclass
class _Context:
    unit: str | None = None
    phase: str | None = None
    step: int = 0
    explicit_step: bool = False


class FlightRecorder:
    """The ring of :class:`Entry` of this process, with per-group sequence numbers."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: collections.deque[Entry] = collections.deque(maxlen=max(capacity, 1))
        self.pending: dict[int, Entry] = {}  # id -> entry, in issue order
        self.seq: dict[str, int] = {}  # group -> last issued sequence number
        self.last_completed: Entry | None = None
        self.context = _Context()

    def issue(self, op: str, dtype: Any, numel: int, nbytes: int, group: str) -> Entry | None:
        """Record a collective being issued on ``group``; None when recording is off."""
        if self.capacity <= 0:
            return None
        seq = self.seq.get(group, 0) + 1
        self.seq[group] = seq
        c = self.context
        e = Entry(group, seq, op, str(dtype), numel, nbytes, c.unit, c.phase, c.step, issued_at=time.time())
        self.entries.append(e)
        self.pending[id(e)] = e
        return e

    def complete(self, e: Entry | None, state: str = "completed") -> None:
        """Mark ``e`` completed (its wait returned), or ended in ``state`` ("failed", "diverged")."""
        if e is None or e.completed_at is not None:
            return
        e.state, e.completed_at, e.probe = state, time.time(), None
        self.pending.pop(id(e), None)
        if state == "completed":
            self.last_completed = e

    def find(self, group: str, seq: int) -> Entry | None:
        """Entry ``seq`` of ``group`` if the ring still holds it (from any thread)."""
        for e in reversed(list(self.entries)):
            if e.group == group and e.seq == seq:
                return e
            if e.group == group and e.seq < seq:
                return None
        return None

    def oldest_pending(self) -> Entry | None:
        """The oldest collective issued and not completed, or None. Called from the watchdog's
        thread: one C-level copy of the values, where an iterator over the live dict raised
        "dictionary changed size during iteration" if the main thread issued or completed a
        collective between its creation and its first step."""
        pending = list(self.pending.values())
        return pending[0] if pending else None

    def last_issued(self) -> Entry | None:
        return self.entries[-1] if self.entries else None


def _capacity() -> int:
    value = os.environ.get("FULLSHARD_FLIGHT_RECORDER_SIZE", "4096")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"FULLSHARD_FLIGHT_RECORDER_SIZE={value!r} is not an integer: set the number of entries to keep"
        ) from None


RECORDER = FlightRecorder(_capacity())


def reset() -> None:
    """Forget the recorded entries and the context (unit, phase, step): a test harness's fresh
    start in a process kept between calls. Sequence numbers go on: every rank resets together,
    and the store's keys of earlier calls never match again."""
    RECORDER.entries.clear()
    RECORDER.pending.clear()
    RECORDER.last_completed = None
    RECORDER.context = _Context()


@contextlib.contextmanager
def at(unit: str | None = None, phase: str | None = None) -> Iterator[None]:
    """Label the collectives issued inside with ``unit`` and/or ``phase`` (restored after); while
    torch.profiler records, the region is the range ``fullshard::<phase> <unit>``."""
    c = RECORDER.context
    old = (c.unit, c.phase)
    if unit is not None:
        c.unit = unit
    if phase is not None:
        c.phase = phase
    token = exposed_comm.open_range(f"fullshard::{c.phase} {c.unit or ''}".rstrip())
    try:
        yield
    finally:
        exposed_comm.close_range(token)
        c.unit, c.phase = old


def labelled(phase: str) -> Callable[[F], F]:
    """Decorator: the collectives a function issues are labelled with ``phase``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with at(phase=phase):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def set_step(step: int) -> None:
    """Label the following collectives with training ``step`` (the jobs call it every step)."""
    RECORDER.context.step = step
    RECORDER.context.explicit_step = True


def root_forward() -> None:
    """Called at each root forward: counts steps when no one sets them."""
    if not RECORDER.context.explicit_step:
        RECORDER.context.step += 1


def dump(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """Write this rank's entries as JSON (format in the module docstring) to ``path``.

    Returns the path. Raises OSError when it cannot be written.
    """
    doc = {
        "format": "fullshard-flight-recorder",
        "version": 1,
        "rank": rank,
        "world_size": world_size,
        "pid": os.getpid(),
        "dumped_at": time.time(),
        "entries": [e.as_dict() for e in list(RECORDER.entries)],
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(out)
    return out
