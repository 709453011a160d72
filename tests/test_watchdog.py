"""The watchdog and flight recorder: programs that would hang (tests/hang_cases.py, under
torchrun at 2 ranks, FULLSHARD_WATCHDOG=1, FULLSHARD_COLLECTIVE_TIMEOUT=3) end within seconds of
the timeout with a line naming the step, phase, unit and collective, and where the other rank is;
ranks whose collectives stop matching, or that leave, are named at once. The watchdog raises in
the main thread, exits only after a grace period, is off unless asked for, and never keeps a
process alive."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist import run_ranks

BIN = Path(sys.executable).parent
CASES = Path(__file__).with_name("hang_cases.py")


def _run_case(
    case: str, tmp: Path, launcher: str = "torchrun", monitor_interval: float = 0.2, timeout: float = 3
) -> tuple[int, str, float]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", FULLSHARD_COLLECTIVE_TIMEOUT=f"{timeout:g}")
    env["FULLSHARD_WATCHDOG"] = "1"  # hang_cases is a library user: the watchdog is opt-in
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
def test_a_stuck_collective_names_the_rank_and_where_it_is(tmp_path: Path) -> None:
    rc, out, seconds = _run_case("slow_data", tmp_path)
    assert rc != 0, out[-4000:]
    where = "forward, step 2); not joined: rank 1 is alive, not in a collective, at hang_cases.py:39 data"
    _check_stuck(out, tmp_path, where)
    # each rank raised the watchdog's line in its main thread (rank 1 while it slept in its data loader)
    assert "[rank0]: fullshard.comm.peers.CollectiveTimeout: rank 0 waited 3 s" in out, out[-4000:]
    assert "[rank1]: fullshard.comm.peers.CollectiveTimeout: rank 1 is not in a collective, at hang_cases.py:39" in out
    print(f"slow_data: stopped after {seconds:.1f} s")  # start-up included; the timeout is 3 s


@pytest.mark.timeout(120)
def test_collectives_of_equal_size_that_differ_are_named_at_once_on_both_ranks(tmp_path: Path) -> None:
    """Rank 1 skips a unit of the same size in every forward: the backend would pair the two
    all-gathers; the divergence check stops both ranks at the first one, with no timeout."""
    rc, out, _ = _run_case("skip_forward", tmp_path, timeout=60)
    assert rc != 0, out[-4000:]
    sentence = (
        "CollectiveDiverged: ranks diverged at collective #3 of group [0,1]: rank 0 issued forward all-gather of "
        "unit 'layers.1' (544 bytes, step 1), rank 1 issued forward all-gather of unit 'layers.2' (544 bytes, step 1)"
    )
    assert sentence in _line(out, "[rank0]: fullshard.comm.peers.CollectiveDiverged"), out[-4000:]
    assert sentence in _line(out, "[rank1]: fullshard.comm.peers.CollectiveDiverged"), out[-4000:]
    assert "every rank of the group has joined it" not in out


@pytest.mark.timeout(120)
def test_a_rank_that_leaves_is_named_with_its_last_completed_collective(tmp_path: Path) -> None:
    rc, out, _ = _run_case("exit_early", tmp_path, timeout=60)
    assert rc != 0, out[-4000:]
    line = _line(out, "[rank0]: fullshard.comm.peers.CollectiveFailed: rank 0:")
    # 4 all-gathers in step 1, 3 in step 2 (layers.2, last in forward, stays gathered into backward)
    assert "all_gather #19 of group [0,1] (544 bytes, unit 'layers.0', forward, step 3) failed" in line, line
    assert (
        "rank 1 exited (last completed: reduce_scatter #18 of group [0,1] (544 bytes, unit 'layers.0', "
        "post-backward reduce-scatter, step 2))" in line
    ), line


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
    # (at step 3: in step 2, whose collectives differ from step 1's, the divergence check first
    # asks rank 1 about the prefetch and finds it gone only at its next look, 0.5 s on)
    rc, out, _ = _run_case("sigkill", tmp_path, monitor_interval=3.0)
    assert rc != 0
    line = _line(out, "CollectiveFailed: rank 0:")
    # backward's first all-gather: layers.1's, prefetched (layers.2 stays gathered from forward)
    assert "(544 bytes, unit 'layers.1', backward prefetch, step 3) failed" in line, line
    # killed: its last heartbeat's report, and how old it is
    assert re.search(r"rank 1 exited \(last completed: .*, as of its heartbeat \d+\.\d s before\)", line), line


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
        "unit 'layers.1', backward prefetch, step 2); not joined: rank 1 is alive, not in a collective, at "
        "hang_cases.py:57 main",
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


MAIN = Path(__file__).with_name("watchdog_main.py")


def _main(case: str, tmp: Path, sigint: str = "default") -> tuple[int, str]:
    """Run watchdog_main.py's ``case``; ``sigint="ignored"`` starts it with SIGINT ignored, as a
    process started in the background, under nohup, or by a parent that ignores it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULLSHARD_")}
    env["FULLSHARD_FLIGHT_RECORDER_DIR"] = str(tmp / "dumps")
    disposition = signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL
    r = subprocess.run(
        [sys.executable, str(MAIN), case],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
    )
    return r.returncode, r.stdout + r.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_the_watchdog_raises_in_the_main_thread_and_exits_only_after_a_grace_period(
    tmp_path: Path, sigint: str
) -> None:
    rc, out = _main("interrupt", tmp_path, sigint)
    assert "timeout 0.5 s (the process group's)" in out, out
    line = _line(out, "main thread raised after")
    assert ": rank 0 waited 1 s (timeout 0.5 s) in all_reduce #2 of group [0] (4 bytes, step 0);" in line, line
    assert rc == 3, out  # the error was caught: the watchdog ended the process after its grace period
    assert "fullshard watchdog: rank 0 still running 1 s after: rank 0 waited" in out and "exiting with code 3" in out
    assert "still alive" not in out


@pytest.mark.timeout(120)
def test_the_watchdog_never_keeps_a_process_alive(tmp_path: Path) -> None:
    rc, out = _main("exit", tmp_path)
    assert rc == 0, out
    assert "threads left at exit: ['MainThread']" in out, out  # the atexit hook stopped and joined it
    assert "terminate called" not in out


def watchdog_settings_body(rank: int, world: int) -> list[object]:
    import threading

    from fullshard.comm import collectives, watchdog

    def threads() -> list[bool]:
        return [t.daemon for t in threading.enumerate() if t.name == "fullshard-watchdog"]

    watchdog.set_collective_timeout(None)
    group = collectives.default_group()
    t = torch.ones(1)
    collectives.all_reduce(t, group)
    seen: list[object] = [watchdog.ACTIVE is None, threads(), collectives.process_group_timeout(group)]
    watchdog.enable_watchdog()
    try:
        collectives.all_reduce(t, group)
        seen += [watchdog.ACTIVE is not None, threads(), watchdog.collective_timeout()]
    finally:
        watchdog.disable_watchdog()
    collectives.all_reduce(t, group)
    return [*seen, watchdog.ACTIVE is None, threads()]


def test_the_watchdog_is_off_for_library_users_until_asked_for() -> None:
    """Off without FULLSHARD_WATCHDOG; on (one daemon thread) after enable_watchdog(), with the
    timeout given to init_process_group (120 s in tests/dist.py); gone after disable_watchdog()."""
    assert "FULLSHARD_WATCHDOG" not in os.environ
    for seen in run_ranks(watchdog_settings_body, 2):
        assert seen == [True, [], 120.0, True, [True], 120.0, True, []], seen


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
    assert watchdog.collective_timeout() == watchdog._PG_TIMEOUT  # the process group's, once one started it
    with pytest.raises(ValueError, match="grace_s must be a positive number"):
        watchdog.enable_watchdog(grace_s=0)


class _Peers:
    """A store channel whose other ranks' heartbeats are given."""

    def __init__(self, rank: int, heartbeats: dict[int, dict]) -> None:
        self.rank, self.heartbeats = rank, heartbeats

    def heartbeat(self, rank: int) -> dict | None:
        return self.heartbeats.get(rank)


def test_a_timeout_where_every_rank_issued_different_collectives_is_a_divergence_not_a_stuck_backend() -> None:
    """Both ranks issued #2 of the group, but not the same collective: the timed-out line names
    the divergence, and does not blame the backend."""
    import time

    from fullshard.comm import diagnosis
    from fullshard.comm.flight_recorder import RECORDER

    group = "7,9"  # a group of this test only
    mine = [RECORDER.issue("all_gather", torch.float32, 8, 32, group) for _ in range(2)]
    mine[1].unit, mine[1].phase = "layers.1", "forward"
    RECORDER.complete(mine[0])
    try:
        peer = {
            "t": time.time(),
            "seq": {group: 2},
            "pending": None,
            "recent": [[group, 1, "all_gather", None, None], [group, 2, "all_gather", "layers.2", "forward"]],
        }
        line = diagnosis.timed_out(_Peers(7, {9: peer}), mine[1], 3.0, 5.0)  # type: ignore[arg-type]
    finally:
        RECORDER.complete(mine[1])
    assert "in all_gather #2 of group [7,9] (32 bytes, unit 'layers.1', forward, step" in line, line
    assert (
        "; ranks diverged at #2 of group [7,9]: rank 9 issued all_gather for unit 'layers.2' (forward) where rank 7 "
        "issued all_gather for unit 'layers.1' (forward)" in line
    ), line
    assert "backend" not in line, line


def test_a_late_watchdog_signals_the_main_thread_before_its_grace_period_ends_the_process(monkeypatch) -> None:
    """On a loaded machine the watchdog's first look after the stop can come later than the grace
    period: it must still signal the main thread first, and exit only a grace period after that."""
    import types

    from fullshard.comm import peers, watchdog

    calls: list[str] = []
    monkeypatch.setattr(peers, "STOP", peers.CollectiveTimeout("rank 0 timed out"))
    monkeypatch.setattr(peers, "RAISED", False)
    monkeypatch.setattr(watchdog, "_interrupt_main", lambda: calls.append("signal"))
    late = time.monotonic() - watchdog._GRACE_S - 1.0  # its first look comes after the grace period
    dog = types.SimpleNamespace(stop_at=late, signalled=False, exit=lambda why: calls.append(why))
    watchdog.Watchdog.watch(dog)  # type: ignore[arg-type]
    assert calls == ["signal"]
    watchdog.Watchdog.watch(dog)  # type: ignore[arg-type]  # within the grace period: nothing
    assert calls == ["signal"]
    dog.stop_at -= watchdog._GRACE_S + 0.1
    watchdog.Watchdog.watch(dog)  # type: ignore[arg-type]
    assert len(calls) == 2 and calls[1].startswith("still running"), calls


def test_an_error_in_a_look_at_the_pending_collectives_does_not_end_the_watchdog(capsys) -> None:
    """The watchdog thread answers the other ranks' collective-order questions, so its end would
    hang them: a look that raises is said once on stderr and the thread goes on (a clean clone's
    MNIST job hung for 280 s on 2026-11-29 after "Exception in thread fullshard-watchdog" in
    ``watch``)."""
    import threading
    import types

    from fullshard.comm import watchdog

    looks: list[int] = []
    stopped = threading.Event()

    def watch() -> None:
        looks.append(1)
        if len(looks) == 3:
            stopped.set()
        raise RuntimeError("dictionary changed size during iteration")

    dog = types.SimpleNamespace(
        stopped=stopped, reported=None, cpu_s=0.0, watch_failed=False, rank=1, watch=watch,
        interval=lambda: 1.0, tick=lambda: 0.0, beat=lambda final=False: None,
        read_inbox=lambda: None, answer=lambda: None,
    )  # fmt: skip
    watchdog.Watchdog.run(dog)  # type: ignore[arg-type]
    assert len(looks) == 3
    err = capsys.readouterr().err
    assert err.count("rank 1: a look failed (RuntimeError: dictionary changed size") == 1, err


def _wait_in_torch() -> None:
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # torch's own collective, not fullshard's


def where_body(rank: int, world: int) -> str:
    """The watchdog's words for where the main thread is: rank 0 while it waits in torch's
    all_reduce for rank 1, rank 1 while it sleeps before joining it."""
    import threading

    from fullshard.comm import diagnosis

    seen: list[str] = []
    look = threading.Thread(target=lambda: (time.sleep(1.0 - rank), seen.append(diagnosis.stack())))
    look.start()
    if rank == 1:
        time.sleep(2.0)
    _wait_in_torch()
    look.join()
    return seen[0]


@pytest.mark.timeout(60)
def test_a_rank_inside_torch_is_named_by_the_user_line_and_torch_collective() -> None:
    """The stack shown is the user's innermost frames (not torch's internals), with the torch
    function called; inside torch.distributed it is "not in a fullshard collective"."""
    inside, sleeping = run_ranks(where_body, 2, timeout=40)
    assert inside.startswith("not in a fullshard collective, at test_watchdog.py:"), inside
    assert " _wait_in_torch < test_watchdog.py:" in inside and "where_body" in inside, inside
    assert inside.endswith(", in torch.distributed.distributed_c10d.all_reduce"), inside
    assert sleeping.startswith("not in a collective, at test_watchdog.py:") and " where_body < " in sleeping, sleeping
    assert "_ops.py" not in inside + sleeping and "threading.py" not in inside + sleeping
