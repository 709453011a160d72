"""What a failed worker leaves: one line on stderr, and its traceback in the job's log file.

Each worker the launcher starts runs its function inside :class:`Guarded`. An exception out of
it prints one line on that rank's stderr and appends the traceback to the job's log file, then
propagates as before (the launcher stops the other workers, restarts the group or fails the
job)::

    fullshard: checkpoint save to /ckpt/step_00000002 failed on rank 1: No space left on device (writing __1_0.distcp)
    fullshard: rank 0: ValueError: ...

A checkpoint error already names the rank that failed (every rank raises it), other errors get
the rank that raised them. torch's elastic agent logs every worker failure with its traceback;
while a job runs, its log records go to the same file instead of the console, and the
launcher's own last line names the file (:func:`log_path`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fullshard.comm.peers import CollectiveFailed, CollectiveTimeout
from fullshard.jobs import launcher_watch
from fullshard.state.checkpoint_errors import CheckpointError, one_line

_CONSEQUENCE_DELAY_S = 0.5  # how long a worker whose collective failed waits before it exits

# torch's loggers that print a worker's failure (with its traceback) in the launching process
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def log_path(run_id: str) -> Path:
    """The log file of the job ``run_id``: tracebacks of its failed workers and its agent's log."""
    return Path(tempfile.gettempdir()) / f"{run_id}.log"


def line(error: BaseException, rank: int) -> str:
    """The one line a worker prints for ``error``: ``fullshard: ...``."""
    if isinstance(error, CheckpointError):
        return f"fullshard: {one_line(error)}"
    return f"fullshard: rank {rank}: {one_line(error)}"


def report(error: BaseException, log: Path, rank: int, print_line: bool = True) -> None:
    """Print the one line for ``error`` on stderr (unless not ``print_line``) and append its
    traceback to ``log``."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        with open(log, "a") as f:  # each rank appends one block in one write
            f.write(f"==== rank {rank} (pid {os.getpid()}, restart {restart}) ====\n{text}\n")
    except OSError:
        pass  # the line below still says what happened
    if print_line:
        sys.stderr.write(line(error, rank) + "\n")  # one write: the ranks' lines do not interleave
        sys.stderr.flush()


_ENV_AT_IMPORT = dict(os.environ)
"""The environment this module was imported under. In a forkserver (which imports it before
forking workers) that is the server's environment, which every worker it forks inherits."""


def adopt_environment(env: dict[str, str]) -> None:
    """Make this worker's environment ``env`` (the launcher's when it launched), keeping what
    torch's elastic agent set for this worker (``RANK``, ``MASTER_PORT``, ...).

    Needed under the ``forkserver`` start method: a forked worker inherits the server's
    environment from when the server started, not the launcher's of this launch. Variables read
    only when a library initializes (``THP_MEM_ALLOC_ENABLE``) are not re-read; the intra-op
    thread count is applied again from ``OMP_NUM_THREADS``.
    """
    from_agent = {k: v for k, v in os.environ.items() if _ENV_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(from_agent)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _take_stdio(handles: tuple[Any, Any]) -> None:
    """Point this worker's file descriptors 1 and 2 at the launcher's (``DupFd`` handles)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target, handle in zip((1, 2), handles):
        fd = handle.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


class Guarded:
    """``fn`` as a worker runs it: a failure prints one line and logs its traceback (picklable,
    named like ``fn`` for torch's launcher). With ``env``, the worker first takes that
    environment (see :func:`adopt_environment`); with ``launcher``, it ends when that process
    ends (:func:`launcher_watch.watch`). A KeyboardInterrupt (Ctrl-C reaches every process of
    the terminal's group; the agent passes a SIGINT on) ends it quietly with exit code 130."""

    def __init__(
        self,
        fn: Callable[..., Any],
        log: Path,
        env: dict[str, str] | None = None,
        stdio: tuple[Any, Any] | None = None,
        launcher: launcher_watch.Launcher | None = None,
    ) -> None:
        self.fn, self.log, self.env, self._stdio, self.launcher = fn, log, env, stdio, launcher
        self.__name__ = getattr(fn, "__name__", "worker")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled for a worker being started: with handles to the launcher's stdout and stderr
        as they are now (a forkserver's workers would otherwise write where the server's went
        when it started, e.g. into an earlier caller's capture)."""
        from multiprocessing import context, reduction

        stdio = None
        if context.get_spawning_popen() is not None:  # multiprocessing passes these descriptors along
            stdio = (reduction.DupFd(1), reduction.DupFd(2))
        return (Guarded, (self.fn, self.log, self.env, stdio, self.launcher))

    def __call__(self, *args: Any) -> Any:
        if self.launcher is not None:
            launcher_watch.watch(self.launcher)
        if self._stdio is not None:
            _take_stdio(self._stdio)
            self._stdio = None
        if self.env is not None:
            adopt_environment(self.env)
        try:
            return self.fn(*args)
        except KeyboardInterrupt:
            raise SystemExit(130) from None  # the launcher prints the one line
        except Exception as e:
            rank = int(os.environ.get("RANK", "0"))
            if _after_ctrl_c(e):  # e.g. a collective the peers left as the same Ctrl-C stopped them
                report(e, self.log, rank, print_line=False)  # the traceback still goes to the log
                raise SystemExit(130) from None
            report(e, self.log, rank)
            if isinstance(e, (CollectiveFailed, CollectiveTimeout)):
                # A consequence of a peer's failure: leave after it, so that the launcher (which
                # names the first exit it sees, polling every 0.1 s) names the peer.
                time.sleep(_CONSEQUENCE_DELAY_S)
            raise


def _after_ctrl_c(error: BaseException) -> bool:
    """Whether ``error`` was raised while a KeyboardInterrupt was being handled (its context)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__
    return False


class _RestartLine(logging.Handler):
    """Prints a line for each worker failure that torch's agent answers with a restart.

    The agent logs each failure it sees (an ERROR record of its multiprocessing module naming the
    exit code and local rank, the rank on one node) and restarts the workers while restarts are
    left; its record of the restart itself is INFO, below its loggers' level.
    """

    def __init__(self, max_restarts: int) -> None:
        super().__init__(logging.ERROR)
        self.max_restarts, self.failures = max_restarts, 0

    def emit(self, record: logging.LogRecord) -> None:
        if not (isinstance(record.msg, str) and record.msg.startswith("failed (exitcode: ")):
            return
        if not (isinstance(record.args, tuple) and len(record.args) >= 2):
            return
        exitcode, rank = record.args[0], record.args[1]
        self.failures += 1
        if self.failures > self.max_restarts:
            return  # the job fails; the launcher's last line says so
        how = f"exit code {exitcode}"
        if isinstance(exitcode, int) and exitcode < 0:
            how = f"killed by {_signal_name(-exitcode)}"
        sys.stderr.write(
            f"fullshard: worker rank {rank} failed ({how}); restarting the workers "
            f"(restart {self.failures} of {self.max_restarts}), from the newest complete checkpoint\n"
        )
        sys.stderr.flush()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def agent_logs_to(log: Path, max_restarts: int = 0) -> Iterator[None]:
    """Send torch's elastic agent's log records to ``log`` (created only if one comes) instead
    of the console while the block runs; print one line for each restart after a worker
    failure (of at most ``max_restarts``)."""
    handler = logging.FileHandler(log, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    restarts = _RestartLine(max_restarts)
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.addHandler(restarts)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.removeHandler(restarts)
            lg.propagate = propagate
        handler.close()
