import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# The suite runs in the benchmarks' environment (huge pages for large CPU tensors), set before
# anything starts a forkserver: benchmark code the tests call then forks its workers from the
# test process's forkserver instead of spawning fresh interpreters (see launch._start_method).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

RAY_LOCK = os.path.join(tempfile.gettempdir(), "fullshard-tests-ray.lock")


# The files that take longest (seconds of one worker, summed from `--durations=0` of a clean
# clone's `make test` on the 2-core machine, 2026-11-27), run first: with `--no-loadscope-reorder`
# (the Makefile's) pytest-xdist's `--dist loadfile` hands out files in collection order; by default
# it sorts them by their number of tests, which handed the long files of few tests out last, one
# worker busy for minutes while the other idled.
# Every test on the shared Ray cluster is in test_elastic.py, so one worker runs them in turn: with
# two files, the second's worker waited for the first's test (135 s once).
LONGEST_FIRST = [
    "test_elastic.py",  # 180 s + test_ray.py's 76 s
    "test_torchtitan.py",  # 239 s
    "test_launcher_signals.py",  # 160 s
    "test_gpt_job.py",  # 128 s
    "test_watchdog.py",  # 121 s
    "test_torchrun_elastic.py",  # 117 s
    "test_plan.py",  # 102 s
    "test_hf.py",  # 75 s
    "test_fsdp2_contract.py",  # 64 s
    "test_mnist_job.py",  # 49 s
    "test_errors.py",  # 44 s
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _ray_address_file(config: pytest.Config) -> Path:
    """Where this run's shared Ray cluster's address is kept: one file per pytest run (the
    pytest-xdist workers' parent, or the single pytest process)."""
    run = os.getppid() if hasattr(config, "workerinput") else os.getpid()
    return Path(tempfile.gettempdir()) / f"fullshard-tests-ray-{run}.address"


def _ray(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    return subprocess.run([ray, *args], capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The environment for a process that runs Ray Train on the run's one local Ray cluster.

    Starting and stopping a Ray instance costs 10-30 s here, so the first test that needs one
    starts it (``ray start --head`` on a free port, its workers' environment set for tests: Train's
    health check every 0.2 s instead of 2 s, as reports wait for it, and no preemption watcher)
    and the run's last act stops it (:func:`pytest_sessionfinish`). The tests using it hold a file
    lock, one at a time, so the Ray worker processes alive during a test are that test's.
    """
    pytest.importorskip("ray.train")
    with open(RAY_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        where = _ray_address_file(request.config)
        if not where.exists():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            # no token: drivers then reach it by address alone (this machine's, not the network's)
            # no preemption watcher: one actor process less per worker group, and a one-node
            # cluster has no node to drain
            env = dict(
                os.environ,
                RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.2",
                RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
                RAY_AUTH_MODE="disabled",
            )
            r = _ray(
                "start", "--head", f"--port={port}", "--num-cpus=8", "--include-dashboard=false",
                "--disable-usage-stats", env=env,
            )  # fmt: skip
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            where.write_text(f"127.0.0.1:{port}")
        yield dict(os.environ, RAY_ADDRESS=where.read_text(), RAY_DEDUP_LOGS="0")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the run's shared Ray cluster, if a test started one (in the process that owns the run)."""
    if hasattr(session.config, "workerinput"):
        return
    where = _ray_address_file(session.config)
    if where.exists():
        _ray("stop", "--force")
        where.unlink()
