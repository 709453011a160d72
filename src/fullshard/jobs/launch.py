"""Starting worker processes: a thin layer over torch.distributed's elastic launcher.

``launch(fn, args, nproc)`` starts ``nproc`` local workers with
``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun`` uses), so the job runs the
same under ``torchrun``. If a worker fails, the launcher's agent stops the others (no hang) and
``launch`` raises :class:`WorkerFailed` with the first failure's message. Each failing worker
prints one line and writes its traceback to the job's log file (:mod:`fullshard.jobs.failures`);
``run_job`` ends with a line naming the failed rank and that file. A restart after a failure
(``max_restarts``) prints a line naming the rank. SIGTERM or Ctrl-C to the launching process
stops the workers and ``run_job`` prints one line (:class:`JobInterrupted`); when the launching
process dies (SIGKILL), its workers end by themselves (:mod:`fullshard.jobs.launcher_watch`).

Inside a worker, ``init_process_group()`` creates the default process group from the
launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): gloo on CPU,
NCCL when the worker has a GPU. It uses a store prefix per restart attempt: after a restart the
launcher's store still holds the dead attempt's gloo addresses, and reusing them hangs.

``launch`` also sets ``OMP_NUM_THREADS`` for its workers unless the environment already sets it
(see :func:`worker_environment`): the CPU cores divided among the workers (``torchrun`` sets 1).
Huge pages (``THP_MEM_ALLOC_ENABLE=1``, torch's CPU allocator backing tensors of 2 MiB and more
with transparent huge pages) are left to the caller: fullshard reuses its buffers across steps
(``fullshard._buffers``), so they no longer pay here (the tiny GPT job: 66 s and 0.55 GiB per
rank without, 70 s and 1.1-1.2 GiB with; the 166M memory-bound benchmark 4% faster with), and
``fullshard bench`` turns them on for every implementation it compares (torch FSDP2's
memory-bound step is 1.65x longer without them).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fullshard import compat
from fullshard.comm import collectives, process_groups
from fullshard.jobs import failures, launcher_watch

# The environment benchmark workers run with (``fullshard bench``): huge pages for large CPU
# tensors, unless the caller's environment says otherwise. torch FSDP2 allocates fresh
# full-parameter buffers every step and its memory-bound step is 1.65x longer without them;
# fullshard reuses its buffers either way.
BENCH_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


class WorkerFailed(RuntimeError):
    """A worker process of a launched job failed; the message holds its error.

    Attributes:
        rank: the first failed worker's rank; exitcode: its exit code (negative: a signal).
        reported: whether the worker printed its own one-line error (it raised an exception;
            False when it was killed or exited).
        log: the job's log file (tracebacks), None when nothing was written to it.
    """

    def __init__(
        self, message: str, rank: int = -1, exitcode: int = 1, reported: bool = False, log: Path | None = None
    ) -> None:
        super().__init__(message)
        self.rank, self.exitcode, self.reported, self.log = rank, exitcode, reported, log

    def summary(self) -> str:
        """One line for the launcher's user: the worker's own line (printed above) is not repeated."""
        head = f"worker rank {self.rank} failed (exit code {self.exitcode})" if self.reported else str(self)
        return head + (f"; tracebacks in {self.log}" if self.log is not None else "")


class JobInterrupted(RuntimeError):
    """The launching process got a termination signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT: the
    ones torch's elastic agent handles); its agent has stopped the workers.

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, the shell's convention (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + self.signum


# The signals torch's agent replaces the handlers of while it runs (TORCHELASTIC_SIGNALS_TO_HANDLE's
# default), restored after it: torch leaves its own in place.
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def default_nproc() -> int:
    """The number of CUDA devices, else 2."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the operating system's pick; another process may take
    it before it is bound again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    fn: Callable[..., Any],
    args: tuple,
    nproc: int,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` local worker processes; return {rank: return value}.

    Args:
        fn: a module-level function (it is pickled into spawned processes).
        args: its arguments (picklable).
        nproc: number of workers, >= 1.
        max_restarts: how often the whole group is restarted after a worker dies.
        env: more environment variables for the workers, each unless the environment already
            sets it (as :func:`worker_environment`'s).

    The workers end as soon as this process ends, even by SIGKILL (see :mod:`launcher_watch`).

    Raises:
        ValueError: ``nproc`` < 1 or ``max_restarts`` < 0.
        WorkerFailed: a worker failed (after the restarts ran out).
        JobInterrupted: this process got SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGQUIT; the workers
            were stopped.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {max_restarts}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # For the workers only (they take them as they start); the caller's environment is restored.
    wanted = {**worker_environment(nproc), **(env or {})}
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    start_method = _start_method(env, fn, {**os.environ, **added})
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"fullshard-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
    )
    os.environ.update(added)
    log = failures.log_path(config.run_id)
    guarded = failures.Guarded(fn, log, dict(os.environ), launcher=launcher_watch.this_process())
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    try:
        with failures.agent_logs_to(log, max_restarts):
            return elastic_launch(config, guarded)(*args)
    except ChildFailedError as e:
        raise _failed(e, log) from None
    except SignalException as e:  # the agent has stopped the workers
        raise JobInterrupted(e.sigval) from None
    except KeyboardInterrupt:  # before the agent's handlers were in place, or after
        raise JobInterrupted(signal.SIGINT) from None
    finally:
        for k in added:
            os.environ.pop(k, None)
        _restore_handlers(handlers)


def _restore_handlers(handlers: dict[signal.Signals, Any]) -> None:
    """Put back the signal handlers torch's agent replaced (it leaves its own, which raise its
    SignalException wherever this process is next, long after the job)."""
    if threading.current_thread() is not threading.main_thread():
        return  # torch's agent did not replace them either
    for sig, handler in handlers.items():
        if handler is not None:  # None: not set from Python; leave it
            signal.signal(sig, handler)


FORKSERVER_PRELOAD = ("torch", "torch.distributed", compat.DYNAMO, "fullshard", "fullshard.jobs.launch")
"""What the forkserver imports once, before it forks any worker. fullshard itself does not import
dynamo (2.6 s), but most workers do: DTensor's constructor and torch's meta-device kernels
(meta initialization) import it on first use."""


# The environment this process's forkserver started with (None until a launch starts it).
_SERVER_ENVIRON: dict[str, str] | None = None


def _start_method(env: dict[str, str] | None, fn: Callable[..., Any], environ: dict[str, str]) -> str:
    """How ``launch`` starts its workers: ``forkserver``, or ``spawn`` where the server's
    environment disagrees with ``env``.

    A forkserver imports torch and fullshard once per launching process (see
    :data:`FORKSERVER_PRELOAD`, plus ``fn``'s module) and forks each worker from that state:
    on the 2-core machine a 2-rank launch of a no-op took 25 s spawned and 0.4-0.7 s forked
    from a running server (10 s for the first, which starts the server), under load.
    Workers take the launcher's environment of their launch as they start
    (:func:`failures.adopt_environment`), but a variable read when a library initializes (the
    allocator's ``THP_MEM_ALLOC_ENABLE`` in :data:`BENCH_ENV`) keeps the server's value. So a
    launch with ``env`` forks only where the server started (or starts now) with the same
    values of ``env``'s variables as this launch's workers get (``environ``: the launcher's
    environment with this launch's additions); otherwise its workers are spawned, from a fresh
    interpreter. ``fullshard bench`` sets :data:`BENCH_ENV` in its own environment first, so
    its launches fork.
    """
    global _SERVER_ENVIRON
    server = _SERVER_ENVIRON if _SERVER_ENVIRON is not None else environ  # None: this launch starts it
    if env and any(server.get(k) != environ.get(k) for k in env):
        return "spawn"
    import multiprocessing

    module = getattr(fn, "__module__", None)
    extra = (module,) if module and module != "__main__" else ()
    multiprocessing.set_forkserver_preload([*FORKSERVER_PRELOAD, *extra])  # used when the server starts
    if _SERVER_ENVIRON is None:
        _SERVER_ENVIRON = dict(environ)
    return "forkserver"


def use_bench_environment() -> None:
    """Put :data:`BENCH_ENV` into this process's environment (each variable unless already set),
    before any launch: the forkserver then starts with it, and benchmark launches fork from it
    instead of spawning (see :func:`_start_method`)."""
    for k, v in BENCH_ENV.items():
        os.environ.setdefault(k, v)


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "caused by a remote worker crashing")
"""Parts of the messages torch's gloo backend raises when another process of the job has gone
(its pair's socket closed): a consequence of that process's failure, never the cause."""


def _failed(error: Any, log: Path) -> WorkerFailed:
    """The WorkerFailed for torch's ChildFailedError, naming the failure that caused the others;
    and the job's log.

    When one worker fails, its peers' collectives fail after it, often within the same second,
    which torch's one-second timestamps cannot order. So the cause is taken to be, in this
    order: a worker killed by a signal; a worker that raised something other than a failed or
    timed-out collective or a connection its peer closed (gloo's, e.g. while the process group
    is still being set up when the peer raises); then the earliest failure (lowest rank on a tie).
    """

    def cause_first(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, f = item
        message = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
        consequence = message.startswith(("CollectiveFailed", "CollectiveTimeout")) or any(
            peer_gone in message for peer_gone in PEER_GONE
        )
        return (0 if f.exitcode is not None and f.exitcode < 0 else 2 if consequence else 1, f.timestamp, rank)

    rank, failure = min(error.failures.items(), key=cause_first)
    raised = isinstance(failure.message, dict)  # an exception's record: the worker printed its line
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
    return WorkerFailed(
        f"worker rank {rank} failed (exit code {failure.exitcode}): {message}",
        rank,
        failure.exitcode,
        raised,
        log if log.exists() else None,
    )


def worker_environment(nproc: int) -> dict[str, str]:
    """What ``launch`` sets for its workers where the environment does not say otherwise.

    ``OMP_NUM_THREADS``: the CPU cores divided among the ``nproc`` workers (at least 1), as
    ``torchrun`` does. With torch's default of one intra-op thread per core in every worker, the
    workers' threads outnumber the cores, and on gloo each collective then waits for a core: on
    the 2-core machine the GPT job's steps took twice as long at 2 ranks.
    """
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}


def run_job(name: str, worker: Callable[[Any], Any], cfg: Any, nproc: int, max_restarts: int = 0) -> tuple[int, Any]:
    """Run ``worker(cfg)`` on every rank: in this process under torchrun, else in ``nproc`` workers.

    Returns:
        (exit code, rank 0's return value or None). A worker failure gives exit code 1: each
        failing worker prints its one line (``fullshard: ...``), then a line prefixed with
        ``name`` names the failed rank and the log file holding the tracebacks. A termination
        signal to this process (Ctrl-C, SIGTERM) stops the workers and gives 128 + the signal's
        number, after one line naming the signal and the newest complete checkpoint.
    """
    if getattr(cfg, "launcher", "torch") == "ray":
        from fullshard.jobs import ray_launcher

        return ray_launcher.run_job(name, worker, cfg)
    if env_world_size() is not None:  # under torchrun: this process is one worker
        log = failures.log_path(f"fullshard-{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}")
        try:
            result = failures.Guarded(worker, log)(cfg)
        except Exception:
            print(f"{name}: rank {rank()} failed; traceback in {log}", file=sys.stderr)
            return 1, None
        return 0, result if rank() == 0 else None
    try:
        results = launch(worker, (cfg,), nproc, max_restarts)
    except WorkerFailed as e:
        print(f"{name}: {e.summary()}", file=sys.stderr)
        return 1, None
    except JobInterrupted as e:
        print(f"{name}: {e}; the workers were stopped; {_newest_checkpoint(cfg)}", file=sys.stderr)
        return e.exit_code, None
    return 0, results.get(0)


def _newest_checkpoint(cfg: Any) -> str:
    """Where the job's newest complete checkpoint is, in words for the interrupted job's line."""
    root = getattr(cfg, "checkpoint_dir", None)
    if not root:
        return "no checkpoints (no --checkpoint-dir)"
    import warnings

    from fullshard import checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the newer, unfinished folders it passes over: not news here
        newest = checkpoint.latest(root) if os.path.isdir(root) else None
    if newest is None:
        return f"no complete checkpoint in {root} yet"
    return f"newest complete checkpoint: {newest} (a rerun resumes from it)"


def init_process_group(timeout_s: float = 300.0) -> torch.device:
    """Create the default process group from the launcher's environment; return this worker's device.

    gloo on CPU; NCCL when CUDA is available and LOCAL_RANK names a device. When a default
    group exists already (Ray Train creates it before the job's code runs), it is used as it is,
    and :func:`destroy_process_group` leaves it to its creator.

    Raises:
        RuntimeError: the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are
            missing: start the job with ``fullshard train`` or ``torchrun``.
    """
    global _OWN_GROUP
    if collectives.is_initialized():
        _OWN_GROUP = False
        if collectives.backend(collectives.default_group()) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    need = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    absent = [k for k in need if k not in os.environ]
    if absent:
        raise RuntimeError(
            f"environment variables {absent} are not set: start workers with `fullshard train ...` "
            "or `torchrun --nproc-per-node N -m fullshard.train ...`"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # torch's convention (env://): the agent's store when the launcher shares it, else rank 0
    # serves a fresh one each round (torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or
    # variables set by hand). The agent's store outlives restarts: a prefix per attempt keeps
    # the dead attempt's gloo addresses out of reach. A fresh store needs none, and must not
    # have one: an agent that joins an elastic job counts its restarts from 0, the others not.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_store else "fresh"
    process_groups.init_process_group(
        backend,
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        rank,
        world,
        f"fullshard_attempt_{attempt}",
        timeout_s,
        device if backend == "nccl" else None,
        host_store=rank == 0 and not agent_store,
    )
    _OWN_GROUP = True
    return device


_OWN_GROUP = False  # whether init_process_group created the default group (else e.g. Ray Train did)


def destroy_process_group() -> None:
    """Tear down the default process group if :func:`init_process_group` created it."""
    global _OWN_GROUP
    if _OWN_GROUP:
        process_groups.destroy_process_group()
        _OWN_GROUP = False


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int | None:
    """WORLD_SIZE from the environment, when running under a launcher."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None
