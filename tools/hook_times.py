"""Wall time per step inside fullshard's hooks, unit methods and collective waits (inclusive:
nested calls count in both), median over steps, for the `compute` bench workload at 2 ranks.

    python tools/hook_times.py 10
    python tools/hook_times.py 10 --by-call      # also each unshard / wait / finish_reduce call
    KEEP_LAST=0 python tools/hook_times.py 10    # with hooks.KEEP_LAST_GATHERED off

Columns: rank 0 ms, rank 1 ms, calls per step. ``--by-call`` adds one row per call of
``Unit.unshard``, ``Unit.wait_for_unshard`` and ``Unit.finish_reduce`` in the step, numbered in
call order and named by unit (``Unit.unshard`` includes the wait when it is not a prefetch).
"""

import collections
import statistics
import sys
import time

import torch

from fullshard.comm import collectives
from fullshard.engine import hooks, shard_sync
from fullshard.engine.unit import Unit
from fullshard.jobs import launch
from fullshard.jobs.bench import workloads

ACC = collections.defaultdict(float)
CNT = collections.defaultdict(int)
BY_CALL = {"Unit.unshard", "Unit.wait_for_unshard", "Unit.finish_reduce"} if "--by-call" in sys.argv else set()


def timed(owner, name, label=None):
    fn = getattr(owner, name)
    label = label or name

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            ACC[label] += dt
            if label in BY_CALL:
                ACC[f"{label}#{CNT[label]:02d}:{getattr(a[0], 'name', '')}"] += dt
            CNT[label] += 1

    setattr(owner, name, wrapper)


for n in ("pre_forward", "post_forward", "_pre_backward", "post_backward", "finish_backward", "prepare_inputs"):
    timed(hooks, n)
for n in (
    "unshard",
    "wait_for_unshard",
    "reduce_grads",
    "finish_reduce",
    "pack_grads",
    "reshard",
    "install_full_params",
    "uninstall_full_params",
    "full_params",
):
    timed(Unit, n, "Unit." + n)
timed(shard_sync, "sync_shards", "shard_sync.sync_shards")
timed(collectives, "all_gather", "collectives.all_gather")
timed(collectives, "reduce_scatter", "collectives.reduce_scatter")
timed(collectives.Handle, "wait", "Handle.wait")


def worker(steps, warmup):
    import os

    hooks.KEEP_LAST_GATHERED = os.environ.get("KEEP_LAST", "1") != "0"
    dev = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        g = collectives.default_group()
        job = workloads.build_job("compute", "fullshard", dev, collectives.group_rank(g))
        per = collections.defaultdict(list)
        for i in range(warmup + steps):
            collectives.barrier(g)
            ACC.clear()
            CNT.clear()
            t0 = time.perf_counter()
            workloads.step(job)
            total = time.perf_counter() - t0
            if i >= warmup:
                per["step"].append(total)
                for k, v in ACC.items():
                    per[k].append(v)
                cnt = dict(CNT)
        out = {k: statistics.median(v) for k, v in per.items()}
        return (out, cnt)
    finally:
        launch.destroy_process_group()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    res = launch.launch(worker, (int(args[0]) if args else 10, 3), 2)
    (a, cnt), (b, _) = res[0], res[1]
    for k in sorted(a, key=lambda k: ("#" in k, k if "#" in k else "", -a[k])):
        print(f"{k:28s} {a[k] * 1e3:8.2f} {b.get(k, 0) * 1e3:8.2f} ms  x{cnt.get(k, 1)}")
