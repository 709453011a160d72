"""Workers end when the process that launched them ends.

``launch`` runs torch's elastic agent inside the launching process, and a forkserver below it
forks the workers (or the launching process spawns them). When the launching process is
SIGKILLed, nothing stops them: the agent that would stop them died with it, the forkserver lives on as
long as they hold its pipe, and a parent-death signal would come from the forkserver, not the
launcher. Unwatched, they trained on, wrote checkpoints, then waited forever in torch's
``_wrap`` for the agent to read their results, while a restarted job wrote the same folder.

So each worker watches the launching process (:func:`watch`): a thread waits on a pidfd of it
(polls its ``/proc`` entry where pidfds are missing) and exits the worker the moment it ends.
The forkserver and multiprocessing's resource tracker then end by themselves (their pipes
close with the last worker).
"""

from __future__ import annotations

import dataclasses
import os
import select
import threading
import time
from pathlib import Path

EXIT_CODE = 1
_POLL_S = 0.5  # the fallback's interval, where os.pidfd_open is missing or refused


@dataclasses.dataclass(frozen=True)
class Launcher:
    """A process, told apart from a later one that reuses its pid.

    Attributes:
        pid: its process id.
        started: its start time, in clock ticks since boot (``/proc/PID/stat``'s 22nd field).
    """

    pid: int
    started: int


def this_process() -> Launcher | None:
    """This process as a :class:`Launcher` (None without a ``/proc`` file system)."""
    started = _started(os.getpid())
    return None if started is None else Launcher(os.getpid(), started)


def _started(pid: int) -> int | None:
    """Start time of the live process ``pid``; None when it does not exist or has exited
    (a zombie, which its parent has not reaped yet)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def watch(launcher: Launcher) -> None:
    """End this process when ``launcher`` has ended (now, when it already has).

    The wait runs in a daemon thread; it exits the process with :data:`EXIT_CODE` (rank 0 prints
    one line first) wherever the main thread is: a step, a collective or a checkpoint save (whose
    unfinished ``.tmp`` folder no resume takes).
    """
    fd: int | None = None
    try:
        fd = os.pidfd_open(launcher.pid)
    except ProcessLookupError:
        _stop(launcher)
    except (AttributeError, OSError):
        pass  # no pidfds here: poll
    if _started(launcher.pid) != launcher.started:  # gone before the pidfd was opened (pid maybe reused)
        _stop(launcher)
    threading.Thread(target=_wait, args=(launcher, fd), name="fullshard-launcher-watch", daemon=True).start()


def _wait(launcher: Launcher, fd: int | None) -> None:
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
    else:
        while _started(launcher.pid) == launcher.started:
            time.sleep(_POLL_S)
    _stop(launcher)


def _stop(launcher: Launcher) -> None:
    """Exit this worker at once (no cleanup that could wait on a peer or write a checkpoint)."""
    if os.environ.get("RANK", "0") == "0":
        line = f"fullshard: the launcher (pid {launcher.pid}) has ended; its workers stop\n"
        try:
            os.write(2, line.encode())
        except OSError:
            pass  # nobody reads stderr any more
    os._exit(EXIT_CODE)
