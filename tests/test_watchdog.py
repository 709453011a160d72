"""The watchdog and flight recorder: five programs that would hang (tests/hang_cases.py, under
torchrun at 2 ranks, FULLSHARD_COLLECTIVE_TIMEOUT=3) end within seconds of the timeout with a
line naming the step, phase, unit and collective, and where the other rank is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
CASES = Path(__file__).with_name("hang_cases.py")


def _run_case(
    case: str, tmp: Path, launcher: str = "torchrun", monitor_interval: float = 0.2, timeout: float = 3
) -> tuple[int, str, float]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", FULLSHARD_COLLECTIVE_TIMEOUT=f"{timeout:g}")
    env["FULLSHARD_FLIGHT_RECORDER_DIR"] = str(tmp / "dumps")
    if launcher == "torchrun":
        cmd = [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            str(monitor_interval),
        ]
        cmd += [str(CASES), case]
    else:  # fullshard's job launcher (torch's elastic agent in this process, spawned workers)
        cmd = [sys.executable, str(CASES), case, "--launcher", "fullshard"]
    start = time.monotonic()
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=100)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - start


def _line(out: str, start: str) -> str:
    lines = [ln for ln in out.splitlines() if start in ln]
    assert lines, out[-4000:]
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "sentence"),
    [
        (
            "skip_forward",
            "ranks diverged at #3 of group [0,1]: rank 1 issued all_gather for unit 'layers.2' (forward) "
            "where rank 0 issued all_gather for unit 'layers.1' (forward)",
        ),
        ("slow_data", "forward, step 2); not joined: rank 1 is alive, not in a collective, at hang_cases.py:38 data"),
    ],
)
def test_a_stuck_collective_names_the_rank_and_where_it_is(tmp_path: Path, case: str, sentence: str) -> None:
    rc, out, seconds = _run_case(case, tmp_path)
    assert rc != 0, out[-4000:]
    _check_stuck(out, tmp_path, sentence)
    print(f"{case}: stopped after {seconds:.1f} s")  # start-up included; the timeout is 3 s


def _check_stuck(out: str, tmp: Path, sentence: str) -> None:
    """Rank 0's watchdog line holds ``sentence``; every live rank says where it is, and both
    flight-recorder dumps land in one directory, ending at the collective that never completed."""
    line = _line(out, "fullshard watchdog: rank 0 waited")
    assert "(timeout 3 s) in all_gather #" in line and sentence in line, line
    assert "fullshard watchdog: rank 1 is not in a collective, at hang_cases.py" in out, out[-4000:]
    dumps = {p.name: json.loads(p.read_text()) for p in (tmp / "dumps").iterdir()}
    assert set(dumps) == {"rank0.json", "rank1.json"}
    rank0 = dumps["rank0.json"]
    assert rank0["format"] == "fullshard-flight-recorder" and rank0["rank"] == 0 and rank0["world_size"] == 2
    last = rank0["entries"][-1]
    assert last["state"] == "issued" and last["op"] == "all_gather" and last["completed_at"] is None
    assert all(e["state"] == "completed" for e in rank0["entries"][:-1])
    assert [e["seq"] for e in rank0["entries"]] == list(range(1, len(rank0["entries"]) + 1))


@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_as_exited(tmp_path: Path) -> None:
    # torchrun's agent stops the survivor when it next polls: 3 s lets rank 0 reach its collective
    rc, out, _ = _run_case("sigkill", tmp_path, monitor_interval=3.0)
    assert rc != 0
    line = _line(out, "CollectiveFailed: rank 0:")
    assert "(544 bytes, unit 'layers.2', backward, step 2) failed" in line and "rank 1 exited" in line, line


@pytest.mark.timeout(120)
def test_a_killed_rank_under_the_job_launcher_is_named_by_the_launcher(tmp_path: Path) -> None:
    """The job launcher notices the death within 0.1 s and stops the survivor itself (it may be
    computing still, not yet in the collective that would fail), naming the killed rank."""
    rc, out, seconds = _run_case("sigkill", tmp_path, "fullshard")
    assert rc == 1, out[-4000:]
    assert "hang_cases: worker rank 1 failed (exit code -9): Signal 9 (SIGKILL)" in out, out[-4000:]
    assert seconds < 60


@pytest.mark.timeout(120)
def test_under_the_job_launcher_a_stuck_rank_is_named_too(tmp_path: Path) -> None:
    """The job launcher's workers (spawned by torch's elastic agent in the launching process)
    time out the same way as torchrun's (rank 1 returned from its step before backward: the
    watchdog names the line it sleeps at), and the launcher reports the failure."""
    rc, out, _ = _run_case("return_before_backward", tmp_path, "fullshard")
    assert rc == 1, out[-4000:]
    _check_stuck(
        out,
        tmp_path,
        "unit 'layers.2', backward, step 2); not joined: rank 1 is alive, not in a collective, at "
        "hang_cases.py:56 main",
    )
    assert "hang_cases: " in out


@pytest.mark.timeout(120)
def test_ranks_with_different_models_fail_at_the_first_forward(tmp_path: Path) -> None:
    # No timeout is involved: a long one keeps a rank that starts late under load from tripping it.
    rc, out, seconds = _run_case("different_model", tmp_path, timeout=30)
    assert rc != 0
    line = _line(out, "[rank1]: RuntimeError: FSDP units differ across ranks")
    assert "at unit #3 in construction order (rank 0: 'layers.2' (1088 bytes); rank 1: 'layers.2' (1024 bytes))" in line
    assert "[rank0]: RuntimeError: FSDP units differ across ranks" in out
    assert not (tmp_path / "dumps").exists()  # no timeout was needed


def test_timeout_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from fullshard.comm import watchdog

    monkeypatch.setenv("FULLSHARD_COLLECTIVE_TIMEOUT", "7.5")
    assert watchdog.collective_timeout() == 7.5
    watchdog.set_collective_timeout(2)
    assert watchdog.collective_timeout() == 2.0
    watchdog.set_collective_timeout(None)
    monkeypatch.setenv("FULLSHARD_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FULLSHARD_COLLECTIVE_TIMEOUT='soon'"):
        watchdog.collective_timeout()
    with pytest.raises(ValueError, match="positive number of seconds"):
        watchdog.set_collective_timeout(0)
    monkeypatch.delenv("FULLSHARD_COLLECTIVE_TIMEOUT")
    assert watchdog.collective_timeout() == watchdog.DEFAULT_TIMEOUT_S
