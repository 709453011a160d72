"""A watchdog that names the culprit when a collective waits too long, and the divergence check.

Off by default for library users; on in ``fullshard train`` (``FULLSHARD_WATCHDOG=1`` unless the
environment says 0) and wherever ``FULLSHARD_WATCHDOG=1`` is set or :func:`enable_watchdog` is
called. It starts at the next collective on the default process group's own store
(``ProcessGroup.get_group_store()``) and stops at
:func:`fullshard.comm.process_groups.destroy_process_group`, :func:`disable_watchdog`, or
interpreter exit (an ``atexit`` hook, before the interpreter tears threads down).

A daemon thread per process publishes a heartbeat to the store every interval (see
:func:`fullshard.comm.diagnosis.heartbeat`), answers the other ranks' questions about its
collectives (:mod:`fullshard.comm.divergence`) and reads their stop messages. When this rank's
oldest pending collective has waited longer than the timeout, it prints one line saying where it
waits and where each rank that has not joined is, writes the flight-recorder dump, tells every
other rank to stop (each prints where it is), and raises :class:`~fullshard.comm.peers.CollectiveTimeout`
with that line in the main thread: where the main thread waits in a collective (on gloo it waits
in slices), else by a SIGINT to the main thread that fullshard's handler turns into that error (a
Ctrl-C stays a KeyboardInterrupt). The launcher then sees the worker fail. If the process is still
alive ``grace_s`` seconds later (its main thread stuck in a call that cannot be interrupted, or the
error caught), the watchdog exits it with :data:`EXIT_CODE` as a last resort.

The timeout in seconds: :func:`set_collective_timeout` (or ``enable_watchdog(timeout=)``), else
``FULLSHARD_COLLECTIVE_TIMEOUT``, else the default process group's own (the ``timeout=`` given to
``torch.distributed.init_process_group``). The dump directory: ``FULLSHARD_FLIGHT_RECORDER_DIR``,
else ``fullshard_flight_recorder`` in the working directory.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fullshard.comm import diagnosis, divergence, flight_recorder, peers
from fullshard.comm.flight_recorder import RECORDER

EXIT_CODE = 3
DEFAULT_GRACE_S = 30.0
_TIMEOUT: float | None = None
_PG_TIMEOUT = 1800.0  # the default process group's, recorded at start (torch's default until then)
_GRACE_S = DEFAULT_GRACE_S
_WANTED: bool | None = None  # None: FULLSHARD_WATCHDOG decides at the first collective
_SESSIONS = 0


def enable_watchdog(timeout: float | None = None, grace_s: float = DEFAULT_GRACE_S) -> None:
    """Turn the watchdog and the divergence check on for this process (every rank must).

    Args:
        timeout: seconds a collective may wait before the job is stopped; None keeps
            :func:`collective_timeout`'s choice (by default the process group's own timeout).
        grace_s: seconds between raising in the main thread and the last-resort exit.

    Raises:
        ValueError: ``timeout`` or ``grace_s`` is not positive.
    """
    global _WANTED, _GRACE_S
    if not grace_s > 0:
        raise ValueError(f"grace_s must be a positive number of seconds, got {grace_s}")
    if timeout is not None:
        set_collective_timeout(timeout)
    _WANTED, _GRACE_S = True, float(grace_s)


def disable_watchdog() -> None:
    """Turn the watchdog off for this process and stop its thread (every rank must)."""
    global _WANTED
    _WANTED = False
    stop()
    peers.clear_stop()


def reset() -> None:
    """Stop the watchdog and forget :func:`enable_watchdog` / :func:`set_collective_timeout`
    (``FULLSHARD_WATCHDOG`` decides again): a test harness's fresh start in a kept process."""
    global _WANTED, _TIMEOUT, _GRACE_S
    stop()
    peers.clear_stop()
    _WANTED, _TIMEOUT, _GRACE_S = None, None, DEFAULT_GRACE_S


def wanted() -> bool:
    """Whether the watchdog should run: :func:`enable_watchdog`, else ``FULLSHARD_WATCHDOG=1``."""
    global _WANTED
    if _WANTED is None:
        _WANTED = os.environ.get("FULLSHARD_WATCHDOG", "0").strip().lower() in ("1", "true", "yes", "on")
    return _WANTED


def set_collective_timeout(seconds: float | None) -> None:
    """Set the watchdog's timeout (seconds) for this process; None returns to the default.

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
        return _PG_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"FULLSHARD_COLLECTIVE_TIMEOUT={value!r}: set a positive number of seconds")
    return seconds


def dump_dir() -> Path:
    return Path(os.environ.get("FULLSHARD_FLIGHT_RECORDER_DIR", "fullshard_flight_recorder"))


class Watchdog(threading.Thread):
    """The heartbeat, answering and timeout thread of one process group's lifetime."""

    def __init__(self, channel: peers.Channel) -> None:
        super().__init__(name="fullshard-watchdog", daemon=True)
        self.channel = channel  # this thread's own store connection
        self.rank = channel.rank
        self.inbox = peers.Inbox(channel)
        self.asks: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.active_at = 0.0  # when the last question came: answer the next ones quickly
        self.stop_at: float | None = None  # when told to stop; then when the main thread was signalled
        self.signalled = False
        self.reported: flight_recorder.Entry | None = None  # the last completed one, as last published
        self.cpu_s = 0.0  # this thread's CPU time so far (seconds; for fullshard bench recorder)
        self.watch_failed = False  # whether a look at the pending collectives raised (said once)

    def run(self) -> None:
        last_beat = -1e9  # the first heartbeat at once: a rank may die before the first interval ends
        while not self.stopped.is_set():
            now = time.monotonic()
            # every interval, and within 0.25 s of a newly completed collective: a rank that is
            # killed is then reported with its last completed collective (nearly) exactly
            since = now - last_beat
            if since >= self.interval() or (RECORDER.last_completed is not self.reported and since >= 0.25):
                self.reported = RECORDER.last_completed
                self.beat()
                last_beat = now
            try:
                self.read_inbox()
                self.answer()
            except Exception:  # the store is gone (its host exited): judge alone
                pass
            try:
                self.watch()
            except Exception as e:  # never end this thread: other ranks' collective checks wait for its answers
                if not self.watch_failed:
                    self.watch_failed = True
                    print(f"fullshard watchdog: rank {self.rank}: a look failed ({type(e).__name__}: {e}); watching on",
                          file=sys.stderr, flush=True)  # fmt: skip
            self.cpu_s = time.thread_time()
            self.stopped.wait(self.tick())
        self.beat(final=True)

    def tick(self) -> float:
        """Seconds until the next look at the inbox: 1 ms while a question waits for this rank's
        main thread, or for 0.25 s after a question came or this rank asked one (more follow: a
        new stretch of collectives), else 0.1 s."""
        guard = GUARD
        last = max(self.active_at, guard.asked_at if guard is not None else 0.0)
        return 0.001 if self.asks or time.monotonic() - last < 0.25 else 0.1

    def interval(self) -> float:
        return min(1.0, max(0.05, collective_timeout() / 5))

    def beat(self, final: bool = False) -> None:
        try:
            self.channel.publish(diagnosis.heartbeat(final))
        except Exception:
            pass

    def read_inbox(self) -> None:
        for message in self.inbox.poll():
            if message["kind"] == "ask":
                self.asks.append(message)
                self.active_at = time.monotonic()
            elif message["kind"] == "stop":
                self.told_to_stop(message)

    def answer(self) -> None:
        """Reply to the questions whose collective this rank's main thread has issued."""
        waiting = []
        for ask in self.asks:
            ready, reply = divergence.reply_for(ask["group"], ask["seq"])
            if ready:
                self.channel.answer(ask["from"], ask["ticket"], reply)
            else:
                waiting.append(ask)
        self.asks = waiting

    def watch(self) -> None:
        """Time out this rank's oldest pending collective; exit when the grace period is over."""
        if peers.STOP is not None:
            now = time.monotonic()
            self.stop_at = self.stop_at or now
            if now - self.stop_at > 0.3 and not peers.RAISED and not self.signalled:
                # Not waiting in a collective (it would have raised by now): signal it, and count
                # the grace period from here, so that a watchdog that ran late (a loaded machine)
                # never exits without having told the main thread first.
                self.signalled = True
                self.stop_at = now
                _interrupt_main()
            elif now - self.stop_at > _GRACE_S:
                self.exit(f"still running {_GRACE_S:g} s after: {peers.STOP}")
            return
        pending = RECORDER.oldest_pending()
        if pending is None or time.time() - pending.issued_at <= collective_timeout():
            return
        if pending.probe is not None and pending.probe():
            return  # finished, its wait not called yet
        stale = max(3 * self.interval(), 2.0)
        line = diagnosis.timed_out(self.channel, pending, collective_timeout(), stale)
        self.say(line)
        self.channel.tell_others({"kind": "stop", "error": "timeout", "message": f"rank {self.rank} timed out"})
        self.stop_main(peers.CollectiveTimeout(line))

    def told_to_stop(self, message: dict[str, Any]) -> None:
        if peers.STOP is not None:
            return
        if message["error"] == "diverged":
            self.say(f"rank {self.rank}: stopping: {message['message']}")
            self.stop_main(peers.CollectiveDiverged(message["message"]))
        else:
            line = f"{diagnosis.where(self.rank)}; stopping: {message['message']}"
            self.say(line)
            self.stop_main(peers.CollectiveTimeout(line))

    def say(self, line: str) -> None:
        """Print ``fullshard watchdog: <line> [flight recorder: <dump>]`` to stderr."""
        text = f"fullshard watchdog: {line}"
        path = dump_dir() / f"rank{self.rank}.json"
        try:
            flight_recorder.dump(path, self.rank, self.channel.world_size)
            text += f" [flight recorder: {path}]"
        except OSError as err:
            text += f" [no flight recorder dump: {err}]"
        print(text, file=sys.stderr, flush=True)

    def stop_main(self, error: peers.CollectiveError) -> None:
        """Make the main thread raise ``error``: where it waits in a collective, else by a signal
        (:meth:`watch`)."""
        if peers.set_stop(error):
            self.stop_at = time.monotonic()

    def exit(self, why: str) -> None:
        print(f"fullshard watchdog: rank {self.rank} {why}; exiting with code {EXIT_CODE}", file=sys.stderr, flush=True)
        self.beat(final=True)
        os._exit(EXIT_CODE)


# The SIGINT handler that turns the watchdog's signal into its error (installed at start when
# Python's own handler is in place, or SIGINT is ignored, from the main thread). A process started
# in the background or under nohup, or by a parent that ignored SIGINT, starts with it ignored
# (the disposition survives exec): the handler goes in there too, and ignores a Ctrl-C as before.
_SIGNALLED = False
_HANDLER_INSTALLED = False
_PREVIOUS: Any = None  # the disposition the handler replaced: default_int_handler or SIG_IGN


def _on_sigint(signum: int, frame: Any) -> None:
    global _SIGNALLED
    if not _SIGNALLED:
        if _PREVIOUS == signal.SIG_IGN:
            return  # a Ctrl-C where SIGINT was ignored: still ignored
        signal.default_int_handler(signum, frame)  # a Ctrl-C: KeyboardInterrupt as always
    _SIGNALLED = False
    if not peers.RAISED:
        peers.raise_stop()


def _install_handler() -> None:
    global _HANDLER_INSTALLED, _PREVIOUS
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if current is signal.default_int_handler or current == signal.SIG_IGN:
        _PREVIOUS = current
        signal.signal(signal.SIGINT, _on_sigint)
        _HANDLER_INSTALLED = True


def _remove_handler() -> None:
    global _HANDLER_INSTALLED
    if _HANDLER_INSTALLED and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, _PREVIOUS)
        _HANDLER_INSTALLED = False


def _interrupt_main() -> None:
    global _SIGNALLED
    main = threading.main_thread()
    if _HANDLER_INSTALLED and main.ident is not None and threading.current_thread() is not main:
        _SIGNALLED = True
        signal.pthread_kill(main.ident, signal.SIGINT)


ACTIVE: Watchdog | None = None
GUARD: divergence.Guard | None = None


def start(store: Any, rank: int, world_size: int, pg_timeout_s: float) -> None:
    """Start the watchdog on ``store`` (the default process group's), once per process group.

    Raises:
        ValueError: ``FULLSHARD_COLLECTIVE_TIMEOUT`` is not a positive number (on every rank).
    """
    global ACTIVE, GUARD, _PG_TIMEOUT, _SESSIONS
    if ACTIVE is not None and ACTIVE.is_alive():
        return
    _PG_TIMEOUT = pg_timeout_s
    collective_timeout()
    _SESSIONS += 1
    peers.clear_stop()
    channel = peers.Channel(store, rank, world_size, _SESSIONS)
    GUARD = divergence.Guard(channel)
    ACTIVE = Watchdog(channel.clone())
    _install_handler()
    ACTIVE.start()


def stop() -> None:
    """Stop the watchdog (before the process group is destroyed, and at exit): its thread writes
    a final heartbeat and ends, so no thread of it is inside the store at interpreter teardown."""
    global ACTIVE, GUARD
    dog, ACTIVE, GUARD = ACTIVE, None, None
    if dog is not None:
        dog.stopped.set()
        dog.join(timeout=5)
    _remove_handler()


atexit.register(stop)
