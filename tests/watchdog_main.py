"""One-rank programs for test_watchdog.py, each in a process of its own (its main thread, Python's
own SIGINT handler): ``python tests/watchdog_main.py CASE``.

- ``interrupt``: a collective is pending past the timeout (0.5 s) while the main thread sleeps in
  Python: the watchdog raises its line there; the program catches it and sleeps on, and the
  watchdog exits the process with code 3 after its grace period (1 s).
- ``exit``: the watchdog runs (started by a collective) and the program ends without destroying
  its process group: the process exits at once, with code 0.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist


def main(case: str) -> None:
    from fullshard.comm import collectives, peers, watchdog
    from fullshard.comm.flight_recorder import RECORDER

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=0.5))
    watchdog.enable_watchdog(grace_s=1.0)
    collectives.all_reduce(torch.ones(1), collectives.default_group())  # starts the watchdog
    dog = watchdog.ACTIVE
    assert dog is not None and dog.daemon, dog
    print(f"timeout {watchdog.collective_timeout():g} s (the process group's)", flush=True)
    if case == "exit":
        return
    RECORDER.issue("all_reduce", torch.float32, 1, 4, "0")  # pending, never completed
    start = time.monotonic()
    try:
        time.sleep(30)
    except peers.CollectiveTimeout as e:
        print(f"main thread raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
    time.sleep(30)  # the error caught, the process goes on: the grace period ends it
    print("still alive", flush=True)


def _threads_at_exit() -> None:  # registered before fullshard's own hook, so it runs after it
    print(f"threads left at exit: {sorted(t.name for t in threading.enumerate())}", flush=True)


if __name__ == "__main__":
    atexit.register(_threads_at_exit)
    main(sys.argv[1])
