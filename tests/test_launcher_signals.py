"""The launcher dies or is told to stop: its workers go with it, and the console gets one line.

Each job runs in a session of its own, so that every process it starts (the launcher, its
forkserver and resource tracker, the workers) can be found, and killed after the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _start(tmp: Path, *more: str, steps: int = 400) -> subprocess.Popen:
    """A GPT job (by default far longer than the test), logging every step, a checkpoint every 2 steps."""
    args = [str(BIN / "fullshard"), "train", "gpt", "--nproc", "2", "--steps", str(steps), "--seq-len", "32", *more]
    args += ["--batch-size", "2", "--eval-batches", "1", "--log-interval", "1", "--no-progress"]
    args += ["--checkpoint-every", "2", "--checkpoint-dir", str(tmp / "ckpt"), "--metrics-file", str(tmp / "m.jsonl")]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def _wait_for_step(proc: subprocess.Popen, metrics: Path, step: int) -> None:
    deadline = time.monotonic() + 200
    while _last_step(metrics) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the job did not reach step {step}"
        time.sleep(0.05)


def _session(sid: int, parents: dict[int, int] | None = None) -> dict[int, str]:
    """The live processes of session ``sid``: {pid: command line} (and into ``parents``, their
    parents' pids)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                    if parents is not None:
                        parents[int(entry.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return found


def _workers(sid: int) -> list[int]:
    """The workers of the job in session ``sid``: the forkserver's children, in start order."""
    parents: dict[int, int] = {}
    found = _session(sid, parents)
    servers = {pid for pid, command in found.items() if "forkserver" in command and parents[pid] == sid}
    return sorted(pid for pid in found if parents[pid] in servers)


def _gone(sid: int, within_s: float) -> tuple[dict[int, str], float]:
    """Wait up to ``within_s`` for session ``sid`` to have no process; (what is left, seconds)."""
    start = time.monotonic()
    while (left := _session(sid)) and time.monotonic() - start < within_s:
        time.sleep(0.1)
    return left, time.monotonic() - start


def _kill_session(sid: int) -> None:
    for pid in _session(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(300)
def test_sigkill_of_the_launcher_ends_its_workers(tmp_path: Path) -> None:
    """Before, the workers (children of the launcher's forkserver) trained on, saved, then
    waited forever in torch's ``_wrap``; now they end within seconds, and with them the
    forkserver and resource tracker, and write no further checkpoint."""
    proc = _start(tmp_path)
    try:
        _wait_for_step(proc, tmp_path / "m.jsonl", 3)
        assert len(_session(proc.pid)) >= 4, _session(proc.pid)  # launcher, forkserver, tracker, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        at_kill = _last_step(tmp_path / "m.jsonl")
        left, took = _gone(proc.pid, within_s=30)
        assert not left, f"still running {took:.0f} s after the launcher's SIGKILL: {left}"
        time.sleep(1)
        assert _last_step(tmp_path / "m.jsonl") <= at_kill + 1  # the step in flight at most
        saved = sorted(int(p.name[5:]) for p in (tmp_path / "ckpt").iterdir() if not p.name.endswith(".tmp"))
        assert saved and saved[-1] <= at_kill + 2, (saved, at_kill)
        err = proc.stderr.read() if proc.stderr else ""
        assert "fullshard: the launcher (pid " in err, err[-3000:]
    finally:
        _kill_session(proc.pid)
        proc.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("to_group", [False, True], ids=["sigterm-to-launcher", "ctrl-c-to-group"])
def test_sigterm_or_ctrl_c_gives_one_line_and_the_signal_exit_code(tmp_path: Path, to_group: bool) -> None:
    """SIGTERM to the launcher, or SIGINT to the whole process group as a terminal's Ctrl-C
    sends it: one line on stderr naming the signal and the newest complete checkpoint (before,
    35 to 100 lines of tracebacks), exit code 128 + the signal, and no process left."""
    proc = _start(tmp_path)
    sig = signal.SIGINT if to_group else signal.SIGTERM
    try:
        _wait_for_step(proc, tmp_path / "m.jsonl", 3)
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
        left, _ = _gone(proc.pid, within_s=30)
    finally:
        _kill_session(proc.pid)
        proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"fullshard train gpt: stopped by {sig.name}; the workers were stopped; "), lines
    assert f"newest complete checkpoint: {tmp_path / 'ckpt'}/step_000000" in lines[0], lines
    assert not left, left


@pytest.mark.timeout(300)
def test_a_restart_after_a_worker_died_says_so(tmp_path: Path) -> None:
    """``--max-restarts``: the restart after a SIGKILLed worker gets a line naming the rank
    (before, nothing on the console told that a restart had happened)."""
    proc = _start(tmp_path, "--max-restarts", "1", steps=6)
    try:
        _wait_for_step(proc, tmp_path / "m.jsonl", 3)
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        _kill_session(proc.pid)
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    want = "fullshard: worker rank 1 failed (killed by SIGKILL); restarting the workers (restart 1 of 1), "
    assert err.count(want) == 1, err[-3000:]
    assert "resumed from" in out, out[-3000:]


def _peer_left_during_ctrl_c() -> None:
    from fullshard.comm.peers import CollectiveFailed

    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:  # e.g. waiting for a reduction while the peer, also Ctrl-C'd, left
        raise CollectiveFailed("rank 1: reduce_scatter #90 of group [0,1] failed (Connection closed by peer)")


def test_an_error_raised_while_a_ctrl_c_is_handled_ends_the_worker_quietly(tmp_path: Path, capfd) -> None:
    """A Ctrl-C reaches every worker; one whose peer left first may fail in a collective while its
    own KeyboardInterrupt unwinds (CI saw its line beside the launcher's). It exits 130, silent,
    its traceback in the job's log (a user's handler of the Ctrl-C may have failed)."""
    from fullshard.jobs.failures import Guarded

    with pytest.raises(SystemExit) as exit_:
        Guarded(_peer_left_during_ctrl_c, tmp_path / "log")()
    assert exit_.value.code == 130
    assert capfd.readouterr().err == ""
    logged = (tmp_path / "log").read_text()
    assert "KeyboardInterrupt" in logged and "CollectiveFailed: rank 1: reduce_scatter #90" in logged, logged


def test_a_backward_stopped_by_ctrl_c_stays_a_keyboard_interrupt_when_its_tidy_up_fails() -> None:
    """The tidy-up after a backward that raised (waiting for reductions in flight) may fail in turn
    when a peer has left; the backward's own error is what propagates, with a note."""
    import torch

    from fullshard.engine import reshard_guard

    class _Stop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x * 1

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            raise KeyboardInterrupt

    def tidy() -> None:
        raise RuntimeError("Connection closed by peer")

    reshard_guard.install()
    loss = _Stop.apply(torch.ones(2, requires_grad=True)).sum()
    reshard_guard.if_backward_fails(tidy)
    with pytest.raises(KeyboardInterrupt) as stopped:
        loss.backward()
    assert stopped.value.__notes__ == [
        "fullshard: tidying up after this error failed too: RuntimeError: Connection closed by peer"
    ]
