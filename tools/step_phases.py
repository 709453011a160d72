"""Per step and rank: wall time of forward, backward and optimizer step, user and system CPU
seconds (all threads) and minor page faults, for one `fullshard bench compare` workload.

    python tools/step_phases.py compute "fullshard,DDP,no communication,torch FSDP2" 12
    FS_KW='{"forward_prefetch": true}' python tools/step_phases.py compute fullshard 12
    FS_QUANT=int8 python tools/step_phases.py memory "fullshard,fullshard quantized" 6

FS_KW: extra FSDP keyword arguments for fullshard (backward_prefetch by name or null).
FS_QUANT: the "fullshard quantized" implementation's --comm-quant spec (default: on).
Columns are medians over the timed steps, in ms.
"""

import os
import resource
import statistics
import sys
import time

import torch

from fullshard.comm import collectives
from fullshard.jobs import launch
from fullshard.jobs.bench import workloads


def ru():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def worker(workload, impl, steps, warmup):
    import json

    kw = json.loads(os.environ.get("FS_KW", "{}"))
    if kw:
        from fullshard import BackwardPrefetch
        from fullshard import FullyShardedDataParallel as FSDP

        if "backward_prefetch" in kw:
            kw["backward_prefetch"] = (
                None if kw["backward_prefetch"] is None else BackwardPrefetch[kw["backward_prefetch"]]
            )
        orig = workloads.wrap

        def _wrap(impl, model, units, device, comm_quant=None):
            if impl != "fullshard":
                return orig(impl, model, units, device, comm_quant)
            chosen = {id(u) for u in units}
            return FSDP(
                model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or id(module) in chosen, **kw
            )

        workloads.wrap = _wrap
    dev = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        g = collectives.default_group()
        job = workloads.build_job(workload, impl, dev, collectives.group_rank(g), os.environ.get("FS_QUANT"))
        rows = []
        for i in range(warmup + steps):
            collectives.barrier(g)
            t0 = time.perf_counter()
            u0, s0, f0 = ru()
            job.optimizer.zero_grad()
            loss = job.loss(job.model, job.batch)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            job.optimizer.step()
            t3 = time.perf_counter()
            u1, s1, f1 = ru()
            if i >= warmup:
                rows.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2, u1 - u0, s1 - s0, f1 - f0))
        med = [statistics.median(c) for c in zip(*rows)]
        allm = collectives.all_gather_object(med, g)
        return allm if collectives.group_rank(g) == 0 else None
    finally:
        launch.destroy_process_group()


if __name__ == "__main__":
    workload = sys.argv[1]
    impls = sys.argv[2].split(",")
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    for impl in impls:
        res = launch.launch(worker, (workload, impl, steps, 3), 2)[0]
        for r, m in enumerate(res):
            print(
                f"{impl:12s} r{r} step {m[0] * 1e3:6.1f} fwd {m[1] * 1e3:6.1f} bwd {m[2] * 1e3:6.1f} opt "
                f"{m[3] * 1e3:5.1f} | user {m[4] * 1e3:6.1f} sys {m[5] * 1e3:5.1f} cpu "
                f"{(m[4] + m[5]) * 1e3:6.1f} faults {m[6]:6.0f}",
                flush=True,
            )
