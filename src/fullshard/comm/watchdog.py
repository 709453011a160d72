"""A watchdog that names the culprit when a collective waits too long, instead of hanging.

A daemon thread per process publishes a heartbeat to the rendezvous store every interval (its
wall time, the last sequence number it issued on each process group, the collective it waits
in, its last completed one, and its main thread's Python stack when it is in none); the store
keeps working while the process group is stuck. When this rank's oldest pending collective has
waited longer than the timeout, it reads the other ranks' heartbeats, prints one line saying
where it waits and which ranks of that group have not joined and where each of those is
(exited, waiting in another collective, or alive outside any collective with its stack), asks
every other rank to print its own line, writes its flight-recorder dump into one directory
shared by all ranks, and exits with :data:`EXIT_CODE` (the elastic launcher then restarts the
job or reports the failure).

The timeout in seconds: :func:`set_collective_timeout`, else ``FULLSHARD_COLLECTIVE_TIMEOUT``,
else :data:`DEFAULT_TIMEOUT_S`. The dump directory: ``FULLSHARD_FLIGHT_RECORDER_DIR``, else
``fullshard_flight_recorder`` in the working directory.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from fullshard.comm import flight_recorder
from fullshard.comm.flight_recorder import RECORDER

DEFAULT_TIMEOUT_S = 300.0
EXIT_CODE = 3
_KEY = "fullshard_watchdog"
_TIMEOUT: float | None = None
_RECENT = 64  # entries a heartbeat carries, to find where two ranks' collectives stopped matching


def set_collective_timeout(seconds: float | None) -> None:
    """Set the watchdog's timeout (seconds) for this process; None returns to the environment's.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    global _TIMEOUT
    if seconds is not None and not seconds > 0:
        raise ValueError(f"collective timeout must be a positive number of seconds, got {seconds}")
    _TIMEOUT = None if seconds is None else float(seconds)


def collective_timeout() -> float:
    """The timeout in seconds (see the module docstring).

    Raises:
        ValueError: ``FULLSHARD_COLLECTIVE_TIMEOUT`` is not a positive number.
    """
    if _TIMEOUT is not None:
        return _TIMEOUT
    value = os.environ.get("FULLSHARD_COLLECTIVE_TIMEOUT")
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"FULLSHARD_COLLECTIVE_TIMEOUT={value!r}: set a positive number of seconds")
    return seconds


def dump_dir() -> Path:
    return Path(os.environ.get("FULLSHARD_FLIGHT_RECORDER_DIR", "fullshard_flight_recorder"))


def _stack() -> str:
    """The main thread's innermost frames, outermost first: ``file:line func`` joined by " < "."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return "unknown"
    frames = traceback.extract_stack(frame)[-4:]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))


class Watchdog(threading.Thread):
    """The heartbeat-and-timeout thread of one process group's lifetime (see module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        super().__init__(name="fullshard-watchdog", daemon=True)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stopped = threading.Event()

    def heartbeat(self) -> dict[str, Any]:
        pending, done = RECORDER.oldest_pending(), RECORDER.last_completed
        return {
            "t": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "seq": dict(RECORDER.seq),
            "pending": pending.describe() if pending else None,
            "completed": done.describe() if done else None,
            "stack": None if pending else _stack(),
            "recent": [[e.group, e.seq, e.op, e.unit, e.phase] for e in list(RECORDER.entries)[-_RECENT:]],
        }

    def run(self) -> None:
        while True:  # the first heartbeat at once: a rank may die before the first interval ends
            try:
                self.store.set(f"{_KEY}/hb/{self.rank}", json.dumps(self.heartbeat()))
                if self.store.check([f"{_KEY}/abort"]):
                    self.fail(f"stopping: {self.store.get(f'{_KEY}/abort').decode()}", propagate=False)
            except Exception:  # the store is gone (its host exited): judge alone
                pass
            pending = RECORDER.oldest_pending()
            if pending is not None and time.time() - pending.issued_at > collective_timeout():
                if pending.probe is None or not pending.probe():  # else finished, its wait not called yet
                    self.fail(self.diagnose(pending), propagate=True)
            if self.stopped.wait(self.interval()):
                return

    def interval(self) -> float:
        return min(1.0, max(0.05, collective_timeout() / 5))

    def peer(self, rank: int) -> dict[str, Any] | None:
        key = f"{_KEY}/hb/{rank}"
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            return None

    def diagnose(self, e: flight_recorder.Entry) -> str:
        """The line for a timed-out entry: where this rank waits, and who has not joined."""
        waited = time.time() - e.issued_at
        head = f"rank {self.rank} waited {waited:.0f} s (timeout {collective_timeout():g} s) in {e.describe()}"
        stale = max(3 * self.interval(), 2.0)
        missing = []
        for r in (int(x) for x in e.group.split(",")):
            if r == self.rank:
                continue
            hb = self.peer(r)
            if hb is None:
                missing.append(f"rank {r} never reported (not started, or the store is unreachable)")
            elif time.time() - hb["t"] > stale:
                missing.append(
                    f"rank {r} exited (silent for {time.time() - hb['t']:.0f} s; last completed: {hb['completed']})"
                )
            elif hb["seq"].get(e.group, 0) >= e.seq:
                continue
            elif hb["pending"]:
                missing.append(f"rank {r} waits in {hb['pending']}")
            else:
                missing.append(
                    f"rank {r} is alive, not in a collective, at {hb['stack']} (last completed: {hb['completed']})"
                )
        diverged = [d for r in (int(x) for x in e.group.split(",")) if r != self.rank and (d := self.divergence(r))]
        tail = ("; " + "; ".join(diverged)) if diverged else ""
        if not missing:
            return f"{head}; every rank of the group has joined it: the backend itself is stuck{tail}"
        return f"{head}; not joined: " + "; ".join(missing) + tail

    def divergence(self, rank: int) -> str | None:
        """Where ``rank``'s recent collectives first differ from this rank's (same group and
        sequence number, another op or unit): the two were paired wrongly from there on."""
        hb = self.peer(rank)
        if hb is None:
            return None
        mine = {(e.group, e.seq): (e.op, e.unit, e.phase) for e in list(RECORDER.entries)[-4 * _RECENT :]}
        for group, seq, op, unit, phase in hb.get("recent", []):
            here = mine.get((group, seq))
            if here is not None and here[:2] != (op, unit):
                return (
                    f"ranks diverged at #{seq} of group [{group}]: rank {rank} issued {op} for unit {unit!r} "
                    f"({phase}) where rank {self.rank} issued {here[0]} for unit {here[1]!r} ({here[2]}): "
                    "rank-dependent control flow around an FSDP unit?"
                )
        return None

    def fail(self, message: str, propagate: bool) -> None:
        """Print ``message``, ask the others to stop (``propagate``), dump, and exit the process."""
        if not propagate:
            pending = RECORDER.oldest_pending()
            where = f"waits in {pending.describe()}" if pending else f"is not in a collective, at {_stack()}"
            message = f"rank {self.rank} {where}; {message}"
        text = f"fullshard watchdog: {message}"
        path = dump_dir() / f"rank{self.rank}.json"
        try:
            flight_recorder.dump(path, self.rank, self.world_size)
            text += f" [flight recorder: {path}]"
        except OSError as err:
            text += f" [no flight recorder dump: {err}]"
        print(text, file=sys.stderr, flush=True)
        if propagate:
            try:
                self.store.set(f"{_KEY}/abort", f"rank {self.rank} timed out")
                time.sleep(3 * self.interval())  # the others print their lines before the launcher stops them
            except Exception:
                pass
        os._exit(EXIT_CODE)


def _exited(hb: dict[str, Any]) -> bool:
    """Whether the process of heartbeat ``hb`` has ended: on this host, by its /proc state
    (gone, or a zombie not yet reaped); elsewhere, unknown (False)."""
    if hb.get("host") != socket.gethostname():
        return False
    try:
        with open(f"/proc/{hb['pid']}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return True


def explain_failure(entry: flight_recorder.Entry, error: BaseException) -> str:
    """The message for a collective the backend failed (a peer's connection closed): which
    collective, and which ranks of its group have exited."""
    rank = ACTIVE.rank if ACTIVE is not None else int(os.environ.get("RANK", "-1"))
    text = f"rank {rank}: {entry.describe()} failed ({str(error).splitlines()[0][:160]})"
    if ACTIVE is None:
        return text
    peers = [int(x) for x in entry.group.split(",") if int(x) != ACTIVE.rank]
    # A killed peer's sockets close before its process is a zombie: look again for up to 2 s.
    deadline = time.monotonic() + 2.0
    while not (gone := _gone(ACTIVE, peers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return text + ("; " + "; ".join(gone) if gone else "")


def _gone(dog: Watchdog, peers: list[int]) -> list[str]:
    """A phrase for each of ``peers`` whose process has exited, by its heartbeat."""
    gone = []
    for r in peers:
        hb = dog.peer(r)
        if hb is not None and _exited(hb):
            gone.append(f"rank {r} exited (last completed: {hb['completed']})")
    return gone


ACTIVE: Watchdog | None = None


def start(store: Any, rank: int, world_size: int) -> None:
    """Start the watchdog on ``store`` (the rendezvous store, prefixed per attempt), once."""
    global ACTIVE
    if ACTIVE is not None and ACTIVE.is_alive():
        return
    collective_timeout()  # a bad FULLSHARD_COLLECTIVE_TIMEOUT fails here, on every rank
    ACTIVE = Watchdog(store, rank, world_size)
    ACTIVE.start()


def stop() -> None:
    """Stop the watchdog (before the process group is destroyed)."""
    global ACTIVE
    if ACTIVE is not None:
        ACTIVE.stopped.set()
        ACTIVE.join(timeout=5)
        ACTIVE = None
