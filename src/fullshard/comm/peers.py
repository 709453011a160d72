"""The other ranks, reached through the c10d store, and the errors that name them.

The watchdog and the divergence check talk to the other ranks while the process group may be
stuck or paired wrongly, so they go through the store the default process group was created on
(``ProcessGroup.get_group_store()``), which keeps answering. Keys live under
``fullshard_watchdog/<session>/``, where the session counts this process's watchdog starts: a
process group whose watchdog starts again (tests reuse one) never reads an older one's keys.

- ``hb/<rank>``: the rank's heartbeat, JSON, written by its watchdog thread every interval and
  once more when it stops (``"final": true``), so its last completed collective is exact then.
- ``inbox/<rank>/<k>``: messages to a rank, numbered by the counter ``inbox/<rank>/n``; its
  watchdog thread reads them in order (``ask`` for the identity of a collective, ``stop``).
- ``answer/<rank>/<k>``: the reply to ask number ``k`` of rank ``rank``.

:data:`STOP` is the exception this process's main thread must raise: set by the watchdog thread
(its own timeout, or a stop from another rank), raised where the main thread waits in a collective
or checks its identity, and by a signal elsewhere (:mod:`fullshard.comm.watchdog`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any


class CollectiveError(RuntimeError):
    """A collective cannot complete; the message names it and what the other ranks did."""


class CollectiveFailed(CollectiveError):
    """A collective failed in the backend; the message names it and the ranks that exited."""


class CollectiveDiverged(CollectiveError):
    """Ranks issued different collectives at the same sequence number; raised before the backend
    runs the mismatched one, on every rank, naming both collectives."""


class CollectiveTimeout(CollectiveError):
    """A collective waited longer than the watchdog's timeout (or another rank's did)."""


STOP: CollectiveError | None = None
STOPPED = threading.Event()  # set with STOP
RAISED = False  # whether the main thread has raised STOP


def set_stop(error: CollectiveError) -> bool:
    """Record the error the main thread must raise; False if one was recorded already."""
    global STOP
    if STOP is not None:
        return False
    STOP = error
    STOPPED.set()
    return True


def clear_stop() -> None:
    """Forget the recorded error (a new watchdog session starts)."""
    global STOP, RAISED
    STOP, RAISED = None, False
    STOPPED.clear()


def raising(error: CollectiveError) -> CollectiveError:
    """Record ``error`` as this rank's stop, raised by the main thread itself (the watchdog sends
    it no signal); returns it, for ``raise peers.raising(...)``."""
    global RAISED
    set_stop(error)
    RAISED = True
    return error


def raise_stop() -> None:
    """Raise :data:`STOP` if it is set (called by the main thread where it waits)."""
    global RAISED
    if STOP is not None:
        RAISED = True
        raise STOP


class Channel:
    """One rank's keys on the store: its heartbeat, the inboxes of all ranks, answers."""

    def __init__(self, store: Any, rank: int, world_size: int, session: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.session = session
        self.prefix = f"fullshard_watchdog/{session}/"

    def clone(self) -> Channel:
        """The same keys through a second store connection (one per thread), where the store can
        open one; else through the same connection (its operations are short: no blocking waits)."""
        try:
            store = self.store.clone()
        except (AttributeError, RuntimeError):
            store = self.store
        return Channel(store, self.rank, self.world_size, self.session)

    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(map(str, parts))

    def send(self, to: int, message: dict[str, Any]) -> None:
        """Put ``message`` (JSON-able) into rank ``to``'s inbox."""
        k = self.store.add(self.key("inbox", to, "n"), 1)
        self.store.set(self.key("inbox", to, k), json.dumps(message))

    def tell_others(self, message: dict[str, Any]) -> None:
        """Send ``message`` to every other rank; a store that is gone is ignored."""
        for r in range(self.world_size):
            if r != self.rank:
                try:
                    self.send(r, message)
                except Exception:  # the store's host exited: nobody is left to tell
                    return

    def publish(self, heartbeat: dict[str, Any]) -> None:
        self.store.set(self.key("hb", self.rank), json.dumps(heartbeat))

    def heartbeat(self, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s last heartbeat, or None (never written, or the store is gone)."""
        key = self.key("hb", rank)
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            return None

    def answer(self, asker: int, ticket: int, reply: dict[str, Any] | None) -> None:
        self.store.set(self.key("answer", asker, ticket), json.dumps(reply))

    def reply(self, ticket: int) -> tuple[bool, dict[str, Any] | None]:
        """(arrived, reply) for this rank's ask number ``ticket``; one store round trip."""
        key = self.key("answer", self.rank, ticket)
        if not self.store.check([key]):
            return False, None
        reply = json.loads(self.store.get(key))
        self.forget(key)
        return True, reply

    def forget(self, key: str) -> None:
        """Delete ``key`` (read once); a store that cannot delete keeps it."""
        try:
            self.store.delete_key(key)
        except Exception:
            pass


class Inbox:
    """The reading end of this rank's inbox (used by its watchdog thread only)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.next = 1
        self.blocked_since: float | None = None

    def poll(self) -> list[dict[str, Any]]:
        """The messages that arrived since the last poll, in order."""
        ch = self.channel
        count = ch.store.add(ch.key("inbox", ch.rank, "n"), 0)
        out = []
        while self.next <= count:
            key = ch.key("inbox", ch.rank, self.next)
            if not ch.store.check([key]):
                # numbered but not written yet; a sender that died in between is skipped after 5 s
                now = time.monotonic()
                self.blocked_since = self.blocked_since or now
                if now - self.blocked_since < 5.0:
                    break
            else:
                out.append(json.loads(ch.store.get(key)))
                ch.forget(key)
            self.blocked_since = None
            self.next += 1
        return out


def exited(hb: dict[str, Any]) -> bool:
    """Whether the process of heartbeat ``hb`` has ended or stopped its watchdog: its last
    heartbeat says so, or on this host its /proc entry is gone or a zombie (elsewhere unknown)."""
    if hb.get("final"):
        return True
    if hb.get("host") != socket.gethostname():
        return False
    try:
        with open(f"/proc/{hb['pid']}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return True


def last_completed(hb: dict[str, Any]) -> str:
    """``last completed: <collective>``, saying how old the report is unless it is final."""
    done = hb.get("completed") or "none"
    if hb.get("final"):
        return f"last completed: {done}"
    return f"last completed: {done}, as of its heartbeat {max(0.0, time.time() - hb['t']):.1f} s before"
