"""The engine's own cost per FSDP unit: a model of tiny blocks, whose compute is next to nothing,
trained unwrapped and per block under each implementation, one step at a time.

    python tools/unit_overhead.py [IMPLS] [--steps 200] [--reps 2]                 # world size 1
    torchrun --nproc-per-node 2 tools/unit_overhead.py [IMPLS] [--steps 200]       # 2 ranks, gloo

IMPLS is a comma-separated subset of ``plain`` (unwrapped), ``fsdp1`` (fullshard's wrapper, one
unit per block), ``fully_shard`` (fullshard's, per block and root) and ``torch`` (torch's
``fully_shard``, the same); all four by default. Each block is two ``Linear(16, 16)``, 32 blocks,
SGD. Rank 0 prints, per implementation and repetition, the median step (ms, wall clock), the
median CPU time of the main thread per step (ms: the hooks, the copies, issuing collectives; not
gloo's threads, not time blocked in a wait), and the step's excess over ``plain`` per unit (us).
At world size 1 nothing is sent, so the excess is the engine's bookkeeping: what a CPU-bound
GPU step (a small model on a fast GPU) pays per unit. Timings vary from run to run on a shared
host: compare two trees by alternating runs (``PYTHONPATH=other/src``) and taking medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

BLOCKS = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def build(impl: str) -> nn.Module:
    """The 32-block model (seed 0), wrapped as ``impl`` says."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fullshard import FullyShardedDataParallel, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    if impl == "fsdp1":
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    if impl in ("fully_shard", "torch"):
        shard = fully_shard if impl == "fully_shard" else torch_fully_shard
        for block in model:
            shard(block)
        shard(model)
    elif impl != "plain":
        raise SystemExit(f"unknown implementation {impl!r}: choose from plain, fsdp1, fully_shard, torch")
    return model


def measure(impl: str, steps: int, warmup: int = 20) -> tuple[float, float]:
    """Median wall seconds and median main-thread CPU seconds of one training step."""
    model = build(impl)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    walls, cpus = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        step()
        walls.append(time.perf_counter() - t)
        cpus.append(time.thread_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("impls", nargs="?", default="plain,fsdp1,fully_shard,torch")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29631")
        dist.init_process_group("gloo", rank=0, world_size=1)
    me = dist.get_rank()
    impls = a.impls.split(",")
    if me == 0:
        print(f"world size {dist.get_world_size()}, {BLOCKS} blocks, median of {a.steps} steps")
    plain = None
    for _ in range(a.reps):
        for impl in impls:
            wall, cpu = measure(impl, a.steps)
            if impl == "plain":
                plain = wall
            extra = ""
            if plain is not None and impl != "plain":
                extra = f"  excess per unit {(wall - plain) / BLOCKS * 1e6:7.1f} us"
            if me == 0:
                print(f"{impl:12s} step {wall * 1e3:8.3f} ms  main-thread CPU {cpu * 1e3:8.3f} ms{extra}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
