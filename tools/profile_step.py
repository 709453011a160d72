"""cProfile of rank 0's training steps for one `fullshard bench compare` workload at 2 ranks:
where an implementation's CPU goes (collective issue and wait, copies, the model's kernels).

    python tools/profile_step.py compute fullshard 10
    python tools/profile_step.py compute DDP 10 cumtime

Arguments: workload, implementation (a name of ``workloads.IMPLEMENTATIONS``), timed steps
(default 10, after 3 untimed), and the pstats sort key (default ``tottime``). Prints the top 45
functions of rank 0; divide by the steps for per-step seconds.
"""

import cProfile
import io
import pstats
import sys

import torch

from fullshard.comm import collectives
from fullshard.jobs import launch
from fullshard.jobs.bench import workloads


def worker(workload: str, impl: str, steps: int, warmup: int, sort: str) -> str:
    dev = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        g = collectives.default_group()
        job = workloads.build_job(workload, impl, dev, collectives.group_rank(g))
        for _ in range(warmup):
            workloads.step(job)
        collectives.barrier(g)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            workloads.step(job)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(45)
        return out.getvalue()
    finally:
        launch.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    workload, impl = a[0], a[1]
    steps = int(a[2]) if len(a) > 2 else 10
    sort = a[3] if len(a) > 3 else "tottime"
    print(launch.launch(worker, (workload, impl, steps, 3, sort), 2)[0])
