"""``fullshard bench recorder``: what fullshard's bookkeeping adds to one collective.

Three settings take turns in the same worker processes (the order reversed every other round,
so drift in the machine's speed hits all alike), each timing ``calls`` one-element all-reduces
(the smallest collective, so the fixed cost shows most):

- off: no flight recorder (``FULLSHARD_FLIGHT_RECORDER_SIZE=0``), no watchdog;
- recorder: the flight recorder alone (a library user's default);
- recorder + watchdog: the watchdog thread and the divergence check as well (``fullshard train``'s
  default, ``FULLSHARD_WATCHDOG=1``): each call is compared with this rank's prediction, and gloo
  waits go in slices.
"""

from __future__ import annotations

import statistics
import time

import torch

from fullshard.comm import collectives, watchdog
from fullshard.comm.flight_recorder import RECORDER
from fullshard.jobs import launch

SETTINGS = ("off", "recorder", "recorder + watchdog")


def _use(setting: str, capacity: int, group: collectives.ProcessGroup, t: torch.Tensor) -> None:
    """Switch to ``setting`` on every rank, then one untimed call (a restarted watchdog's first
    call is not yet predicted: it asks the other ranks once)."""
    collectives.barrier(group)
    watchdog.disable_watchdog()
    RECORDER.capacity = 0 if setting == "off" else capacity
    if setting == "recorder + watchdog":
        watchdog.enable_watchdog()
    collectives.barrier(group)
    collectives.all_reduce(t, group)


def _worker(calls: int, rounds: int) -> list[dict[str, float]]:
    """Seconds per call of each setting, per round."""
    launch.init_process_group()
    try:
        group = collectives.default_group()
        t = torch.zeros(1)
        capacity, out = RECORDER.capacity, []
        for r in range(rounds):
            per_setting = {}
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                _use(setting, capacity, group, t)
                start = time.perf_counter()
                for _ in range(calls):
                    collectives.all_reduce(t, group)
                per_setting[setting] = (time.perf_counter() - start) / calls
            out.append(per_setting)
        _use("recorder", capacity, group, t)
        return out
    finally:
        launch.destroy_process_group()


def report(calls: int, rounds: int, nproc: int) -> list[str]:
    """``calls`` one-element all-reduces per setting and round at ``nproc`` ranks on gloo; the
    median over rounds on rank 0, in microseconds, as lines of markdown."""
    results = launch.launch(_worker, (calls, rounds), nproc, env=launch.BENCH_ENV)[0]
    us = {s: statistics.median(r[s] for r in results) * 1e6 for s in SETTINGS}
    return [
        f"Per-collective cost: {calls} one-element all-reduces x {rounds} rounds per setting, {nproc} ranks, "
        f"gloo, torch {torch.__version__} (median over rounds, rank 0)",
        "| setting | per collective (us) | vs off |",
        "|---|---|---|",
        f"| off (FULLSHARD_FLIGHT_RECORDER_SIZE=0, no watchdog) | {us['off']:.1f} | |",
        f"| flight recorder (library default) | {us['recorder']:.1f} | {us['recorder'] - us['off']:+.1f} |",
        f"| recorder + watchdog + divergence check (fullshard train) | {us['recorder + watchdog']:.1f} | "
        f"{us['recorder + watchdog'] - us['off']:+.1f} |",
    ]
