"""Opt-in probes for tests and benchmarks: gathered-unit counts, an event log, collective counts.

Off by default. The engine's hot path checks one module attribute, :data:`ACTIVE`, and does
nothing more while it is None; :func:`enabled` installs a fresh :class:`Probes` for the
duration of a ``with`` block and restores the previous value on exit, also when the block
raises::

    with probes.enabled(events=True) as p:
        loss = model(x).sum(); loss.backward()
    assert p.gathered.now == 0
    p.events  # [("unshard", "blocks.0"), ("forward", "blocks.0"), ...]

This module imports nothing from fullshard, so every layer may import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any


class GatherTracker:
    """Count of units whose full parameters are materialized in this process, with its peak.

    ``now`` / ``peak``: units; ``peak_bytes``: bytes of their full parameters at the peak.
    """

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.peak_bytes = 0
        self._bytes = 0

    def add(self, nbytes: int) -> None:
        """One unit's full parameters (``nbytes`` bytes) became materialized."""
        self.now += 1
        self._bytes += nbytes
        self.peak = max(self.peak, self.now)
        self.peak_bytes = max(self.peak_bytes, self._bytes)

    def remove(self, nbytes: int) -> None:
        """One unit's full parameters (``nbytes`` bytes) were freed."""
        self.now -= 1
        self._bytes -= nbytes

    def reset_peak(self) -> None:
        """Start a new peak from what is materialized now."""
        self.peak = self.now
        self.peak_bytes = self._bytes


@dataclasses.dataclass
class CollectiveStats:
    """Counts of collective calls and of bytes each rank put on the wire, per op name.

    ``log``: when a list, each call appends ``(op, dtype, numel)`` of its input.
    """

    calls: Counter = dataclasses.field(default_factory=Counter)
    bytes_sent: Counter = dataclasses.field(default_factory=Counter)
    log: list[tuple[str, Any, int]] | None = None

    def reset(self) -> None:
        """Zero the counts and empty the log (if one is kept)."""
        self.calls.clear()
        self.bytes_sent.clear()
        if self.log is not None:
            self.log.clear()

    def record(self, op: str, dtype: Any, numel: int, sent_bytes: int) -> None:
        """One call of ``op`` on ``numel`` elements of ``dtype``; ``sent_bytes`` bytes sent."""
        self.calls[op] += 1
        self.bytes_sent[op] += sent_bytes
        if self.log is not None:
            self.log.append((op, dtype, numel))


@dataclasses.dataclass
class Probes:
    """What the engine reports while probes are enabled.

    ``gathered``: units materialized now and at the peak. ``collectives``: calls and bytes per
    op. ``events``: when a list, ``(event, unit name)`` in order: "unshard" (all-gather
    issued), "forward" / "forward_end", "backward" (pre-backward) and "reduce".
    """

    gathered: GatherTracker = dataclasses.field(default_factory=GatherTracker)
    collectives: CollectiveStats = dataclasses.field(default_factory=CollectiveStats)
    events: list[tuple[str, str]] | None = None


ACTIVE: Probes | None = None


def reset() -> None:
    """Turn the probes off (a test harness's fresh start in a kept process)."""
    global ACTIVE
    ACTIVE = None


@contextlib.contextmanager
def enabled(events: bool = False, collective_log: bool = False) -> Iterator[Probes]:
    """Turn the probes on for a ``with`` block; yields the :class:`Probes` being filled.

    Args:
        events: keep the ordered event log (``Probes.events``).
        collective_log: keep ``(op, dtype, numel)`` of each collective (``Probes.collectives.log``).

    Units that are materialized when the block starts are not counted in ``gathered``: enable
    the probes between steps. On exit the previous probes (usually None) are restored, also
    when the block raises.
    """
    global ACTIVE
    previous = ACTIVE
    ACTIVE = Probes(events=[] if events else None)
    if collective_log:
        ACTIVE.collectives.log = []
    try:
        yield ACTIVE
    finally:
        ACTIVE = previous


def record_event(event: str, unit_name: str) -> None:
    """Append ``(event, unit_name)`` to the event log when probes with events are enabled."""
    if ACTIVE is not None and ACTIVE.events is not None:
        ACTIVE.events.append((event, unit_name))
