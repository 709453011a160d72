"""``fullshard bench recorder``: what fullshard's bookkeeping adds to one collective.

Three settings take turns in the same worker processes (the order reversed every other round),
each timing ``calls`` one-element all-reduces (the smallest collective, so the fixed cost shows
most):

- off: no flight recorder (``FULLSHARD_FLIGHT_RECORDER_SIZE=0``), no watchdog;
- recorder: the flight recorder alone (a library user's default);
- recorder + watchdog: the watchdog thread and the divergence check as well (``fullshard train``'s
  default, ``FULLSHARD_WATCHDOG=1``): each call is compared with this rank's prediction, gloo
  waits go in slices, and the watchdog's thread polls the store. Timed in its steady state (its
  thread polls faster for 0.25 s after a question: the run starts after that).

Each setting's cost is the median over rounds of its difference to ``off`` in the same round
(paired, so the machine's drift between rounds cancels), in wall time and in the main thread's CPU
time; the watchdog thread's own CPU time is given per second of wall time (it runs beside the
collectives, not in them). A last row times collectives the divergence check did not predict (a
new element count each): each asks the other ranks through the store first.
"""

from __future__ import annotations

import statistics
import time

import torch

from fullshard.comm import collectives, watchdog
from fullshard.comm.flight_recorder import RECORDER
from fullshard.jobs import launch

SETTINGS = ("off", "recorder", "recorder + watchdog")
_NAMES = {
    "off": "off (FULLSHARD_FLIGHT_RECORDER_SIZE=0, no watchdog)",
    "recorder": "flight recorder (library default)",
    "recorder + watchdog": "recorder + watchdog + divergence check (fullshard train)",
}
_NEW = 20  # unpredicted collectives timed per round


def _use(setting: str, capacity: int, group: collectives.ProcessGroup, t: torch.Tensor) -> None:
    """Switch every rank to ``setting``; a restarted watchdog's first calls ask the other ranks,
    and its thread polls faster for a while: wait that out."""
    collectives.barrier(group)
    watchdog.disable_watchdog()
    RECORDER.capacity = 0 if setting == "off" else capacity
    if setting == "recorder + watchdog":
        watchdog.enable_watchdog()
    for _ in range(2):  # the second time round, every call below is the predicted one
        collectives.barrier(group)
        collectives.all_reduce(t, group)
        collectives.all_reduce(t, group)


def _timed(calls: int, group: collectives.ProcessGroup, sizes: list[int]) -> tuple[float, float, float]:
    """Per all-reduce, ``calls`` of them cycling through ``sizes`` elements: wall seconds, the
    main thread's CPU seconds, and the watchdog thread's CPU seconds per wall second (0 without)."""
    tensors = [torch.zeros(n) for n in sizes]
    if len(sizes) == 1:  # into the run's steady state: predicted, the watchdog's thread back to slow polls
        for _ in range(3):
            collectives.all_reduce(tensors[0], group)
        time.sleep(0.3)
    dog = watchdog.ACTIVE
    dog_cpu = dog.cpu_s if dog is not None else 0.0
    start, cpu = time.perf_counter(), time.thread_time()
    for i in range(calls):
        collectives.all_reduce(tensors[i % len(tensors)], group)
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return wall / calls, cpu / calls, (dog.cpu_s - dog_cpu) / wall if dog is not None else 0.0


def _worker(calls: int, rounds: int) -> list[dict[str, tuple[float, float, float]]]:
    """:func:`_timed` of each setting, and of unpredicted calls, per round."""
    launch.init_process_group()
    try:
        group = collectives.default_group()
        t = torch.zeros(1)
        capacity, out = RECORDER.capacity, []
        for r in range(rounds):
            per_setting = {}
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                _use(setting, capacity, group, t)
                collectives.barrier(group)
                per_setting[setting] = _timed(calls, group, [1])
                if setting == "recorder + watchdog":  # element counts never seen before: each one asks
                    per_setting["new"] = _timed(_NEW, group, list(range(2 + r * _NEW, 2 + (r + 1) * _NEW)))
            out.append(per_setting)
        _use("recorder", capacity, group, t)
        return out
    finally:
        launch.destroy_process_group()


def report(calls: int, rounds: int, nproc: int) -> list[str]:
    """``calls`` one-element all-reduces per setting and round at ``nproc`` ranks on gloo, on
    rank 0, then at 1 rank, in microseconds, as lines of markdown."""
    results = launch.launch(_worker, (calls, rounds), nproc, env=launch.BENCH_ENV)[0]

    def median(setting: str, i: int, minus: str | None = None) -> float:
        return 1e6 * statistics.median(r[setting][i] - (r[minus][i] if minus else 0.0) for r in results)

    rows = [
        f"| {_NAMES[s]} | {median(s, 0):.1f} | {median(s, 0, 'off'):+.1f} | {median(s, 1):.1f} | "
        f"{median(s, 1, 'off'):+.1f} | {median(s, 2) / 1e3:.1f} |"
        for s in SETTINGS
    ]
    rows.append(
        f"| divergence check, a collective it did not predict (asks the others) | {median('new', 0):.1f} | "
        f"{median('new', 0, 'recorder + watchdog'):+.1f} (vs predicted) | {median('new', 1):.1f} | "
        f"{median('new', 1, 'recorder + watchdog'):+.1f} (vs predicted) | {median('new', 2) / 1e3:.1f} |"
    )
    one = launch.launch(_worker, (calls, rounds), 1, env=launch.BENCH_ENV)[0]
    best = {s: 1e6 * min(r[s][0] for r in one) for s in SETTINGS}
    rows += [
        "",
        f"The same at 1 rank (no other rank to wait for: the bookkeeping's own time), fastest of {rounds} rounds:",
        "| setting | wall per call (us) | vs off |",
        "|---|---|---|",
        *(f"| {_NAMES[s]} | {best[s]:.1f} | {best[s] - best['off']:+.1f} |" for s in SETTINGS),
    ]
    return [
        f"Per-collective cost: {calls} one-element all-reduces x {rounds} rounds per setting, {nproc} ranks, "
        f"gloo, torch {torch.__version__} (rank 0; medians over rounds; 'vs off': the median of each round's "
        "difference)",
        "| setting | wall per call (us) | vs off | main thread CPU per call (us) | vs off | watchdog thread CPU "
        "(ms per s) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
