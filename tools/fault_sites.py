"""Minor page faults per step of fullshard's `compute` bench workload at 2 ranks, attributed to
the stretch between two engine calls (``Unit.unshard``, ``pack_grads``, ``reduce_grads``,
``finish_reduce``, ``reshard``; ``<`` on entry, ``>`` on return), mean over the timed steps.

    python tools/fault_sites.py 12

A stretch like ``unshard>blocks.2 -> reshard<blocks.3`` is the model's own compute in between
(block 3's forward): faults there are its activations' pages, not an FSDP buffer's.
"""

import collections
import resource
import sys

import torch

from fullshard.comm import collectives
from fullshard.engine.unit import Unit
from fullshard.jobs import launch
from fullshard.jobs.bench import workloads

FAULTS: dict[str, int] = collections.defaultdict(int)
LAST: list = ["step", 0]


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def mark(label: str) -> None:
    now = _minflt()
    FAULTS[f"{LAST[0]} -> {label}"] += now - LAST[1]
    LAST[0], LAST[1] = label, now


def _marked(name: str) -> None:
    fn = getattr(Unit, name)

    def wrapper(self, *a, **k):  # type: ignore[no-untyped-def]
        mark(f"{name}<{self.name}")
        try:
            return fn(self, *a, **k)
        finally:
            mark(f"{name}>{self.name}")

    setattr(Unit, name, wrapper)


for _name in ("unshard", "pack_grads", "reduce_grads", "finish_reduce", "reshard"):
    _marked(_name)


def worker(steps: int, warmup: int) -> dict[str, float]:
    dev = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        g = collectives.default_group()
        job = workloads.build_job("compute", "fullshard", dev, collectives.group_rank(g))
        per: dict[str, list[int]] = collections.defaultdict(list)
        for i in range(warmup + steps):
            collectives.barrier(g)
            FAULTS.clear()
            LAST[0], LAST[1] = "step", _minflt()
            job.optimizer.zero_grad()
            loss = job.loss(job.model, job.batch)
            mark("loss")
            loss.backward()
            mark("backward end")
            job.optimizer.step()
            mark("optimizer end")
            if i >= warmup:
                for k, v in FAULTS.items():
                    per[k].append(v)
        return {k: sum(v) / steps for k, v in per.items()}
    finally:
        launch.destroy_process_group()


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    for rank, faults in launch.launch(worker, (steps, 3), 2).items():
        print(f"rank {rank}: {sum(faults.values()):.0f} minor faults a step")
        for k, v in sorted(faults.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {v:8.1f}  {k}")
