"""`fullshard train gpt` under torchrun agents as "nodes" on loopback (c10d rendezvous, gloo,
``--nnodes 1:2 --nproc-per-node 1`` each): one node leaves mid-run (scale-in), another joins the
running job (scale-out); each time the job re-rendezvouses, loads its newest checkpoint resharded
to the new world size and goes on, and it finishes with the loss curve of an uninterrupted 2-rank
run. ``--global-batch-size`` keeps each step's samples independent of the world size (gradient
accumulation makes up the difference), and the gradient norm is summed in float64, so only the
loss reports' summation order differs (1.4e-7 relative at most over 120 steps when measured).

torch's shared rendezvous store (its default since 2.4) cannot take a node that joins after the
first round (see docs/elastic.md, "Multi-node and elastic training"): the agents run with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/elastic.md tells users to.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fullshard.jobs import launch

BIN = Path(sys.executable).parent
# Long enough that node C joins while the 1-rank job still runs: with 80 steps the 1-rank part
# (about 24 s) ended before C got in once, under the whole suite's load.
STEPS = 160
JOB = ["--steps", str(STEPS), "--seq-len", "32", "--batch-size", "4", "--global-batch-size", "8"]
JOB += ["--log-interval", "1", "--eval-batches", "1", "--checkpoint-every", "4"]


def _env() -> dict[str, str]:
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _agent(tmp: Path, name: str, port: int) -> subprocess.Popen:
    """One torchrun agent ("node") of the elastic job, in a session of its own."""
    cmd = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job", "--max-restarts", "3"]
    cmd += ["--rdzv-conf", "last_call_timeout=1,join_timeout=120", "--monitor-interval", "0.2"]
    cmd += ["-m", "fullshard.train", "gpt", *JOB, "--checkpoint-dir", str(tmp / "ckpt")]
    cmd += ["--metrics-file", str(tmp / "m.jsonl")]
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_listener(port: int, agent: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert agent.poll() is None and time.monotonic() < deadline, "agent A never hosted the rendezvous"
            time.sleep(0.05)


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _wait_for_steps(metrics: Path, n: int, deadline: float) -> None:
    while len(_records(metrics)) < n:
        assert time.monotonic() < deadline, f"no {n} metric records in time"
        time.sleep(0.05)


def _curve(metrics: Path) -> dict[int, dict]:
    """The last record of each step (steps after a checkpoint are trained and logged again)."""
    return {rec["step"]: rec for rec in _records(metrics)}


def _finish(agents: list[subprocess.Popen], tmp: Path, timeout: float) -> str:
    try:
        for a in agents:
            a.wait(timeout=timeout)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    return (tmp / "A.log").read_text()


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL the agent and its worker: torchrun starts workers in sessions of their own."""
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    for pid in [agent.pid, *map(int, workers)]:
        os.kill(pid, signal.SIGKILL)
    agent.wait(timeout=30)


def _same_curve(run: Path, reference: dict[int, dict]) -> None:
    curve = _curve(run)
    assert sorted(curve) == list(range(1, STEPS + 1))
    for step, rec in curve.items():
        ref = reference[step]
        for key in ("train_loss", "val_loss"):
            assert rec[key] == pytest.approx(ref[key], rel=1e-4), (step, key, rec[key], ref[key])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The uninterrupted 2-rank run, started by fullshard's own launcher."""
    tmp = tmp_path_factory.mktemp("reference")
    cmd = [str(BIN / "fullshard"), "train", "gpt", "--nproc", "2", *JOB, "--checkpoint-dir", str(tmp / "ckpt")]
    cmd += ["--metrics-file", str(tmp / "m.jsonl")]
    r = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    curve = _curve(tmp / "m.jsonl")
    assert {rec["world_size"] for rec in curve.values()} == {2}
    return curve


@pytest.mark.timeout(500)
def test_two_ranks_to_one_and_back_keep_the_loss_curve(tmp_path: Path, reference: dict) -> None:
    """2 -> 1 -> 2 ranks: node B is SIGKILLed mid-run (scale-in: A restarts alone from the newest
    checkpoint), then node C joins the running 1-rank job (scale-out: both restart at 2 ranks)."""
    metrics, port = tmp_path / "m.jsonl", launch.free_port()
    a = _agent(tmp_path, "A", port)  # hosts the rendezvous endpoint: the node that stays
    _wait_for_listener(port, a)  # B must not host the store: it is the node that leaves
    b = _agent(tmp_path, "B", port)
    agents = [a, b]
    try:
        _wait_for_steps(metrics, 10, time.monotonic() + 240)
        assert _records(metrics)[-1]["world_size"] == 2
        _kill_node(b)
        agents = [a]
        deadline = time.monotonic() + 240
        while _records(metrics)[-1]["world_size"] != 1:
            assert time.monotonic() < deadline and a.poll() is None, "no 1-rank step"
            time.sleep(0.05)
        agents.append(_agent(tmp_path, "C", port))
    finally:
        log = _finish(agents, tmp_path, timeout=240)
    assert [ag.returncode for ag in agents] == [0, 0], log[-3000:]
    sizes = [rec["world_size"] for rec in _records(metrics)]
    changes = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert changes == [2, 1, 2], (changes, log[-3000:])
    assert log.count("resumed from") == 2, log[-3000:]
    _same_curve(metrics, reference)
