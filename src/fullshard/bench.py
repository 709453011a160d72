"""``fullshard bench``: timings of fullshard configurations on this machine, as ratios.

``fullshard bench prefetch [--nproc 2] [--steps 12]`` trains a stack of large Linear layers
(communication-heavy: many parameters, small batch) with FULL_SHARD under each prefetch setting
and prints the median step time of each, with its ratio to the no-prefetch run. Timings belong
here and in BENCHMARKS.md, never in test assertions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn

from fullshard import _collectives as C
from fullshard import launch
from fullshard.api import BackwardPrefetch
from fullshard.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy

PREFETCH_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("no prefetch", {"backward_prefetch": None, "forward_prefetch": False}),
    ("BACKWARD_POST", {"backward_prefetch": BackwardPrefetch.BACKWARD_POST, "forward_prefetch": False}),
    ("BACKWARD_PRE", {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": False}),
    ("BACKWARD_PRE + forward_prefetch", {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": True}),
]


class _Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def _timed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """Seconds of one training step, as long as the slowest rank took."""
    group = C.default_group()
    C.barrier(group)
    start = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    C.all_reduce_max(elapsed, group)
    return float(elapsed.item())


def interleaved_medians(models: Sequence[nn.Module], x: torch.Tensor, steps: int, warmup: int = 3) -> list[float]:
    """Median step seconds per model, the models taking turns step by step (drift hits all)."""
    opts = [torch.optim.SGD(m.parameters(), lr=1e-4) for m in models]
    times: list[list[float]] = [[] for _ in models]
    for i in range(warmup + steps):
        for k, (m, o) in enumerate(zip(models, opts)):
            t = _timed_step(m, o, x)
            if i >= warmup:
                times[k].append(t)
    return [statistics.median(t) for t in times]


def prefetch_worker(d: int, layers: int, batch: int, steps: int) -> Optional[list[tuple[str, float]]]:
    """One rank: median step seconds of each prefetch setting (rank 0 returns them)."""
    device = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        models = []
        for _, kwargs in PREFETCH_CONFIGS:
            torch.manual_seed(0)
            stack = nn.Sequential(*[_Layer(d) for _ in range(layers)]).to(device)
            models.append(FSDP(stack, auto_wrap_policy=ModuleWrapPolicy({_Layer}), **kwargs))
        x = torch.randn(batch, d, device=device)
        medians = interleaved_medians(models, x, steps)
        rows = [(name, t) for (name, _), t in zip(PREFETCH_CONFIGS, medians)]
        return rows if C.group_rank(C.default_group()) == 0 else None
    finally:
        launch.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``fullshard bench``."""
    p = argparse.ArgumentParser(prog="fullshard bench", description=__doc__)
    p.add_argument("workload", choices=["prefetch"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    rows = launch.launch(prefetch_worker, (args.d_model, args.layers, args.batch, args.steps), args.nproc)[0]
    assert rows is not None
    base = rows[0][1]
    params = args.layers * (args.d_model**2 + args.d_model)
    print(f"prefetch benchmark: {args.layers} x Linear({args.d_model}, {args.d_model}) ({params / 1e6:.1f}M params), "
          f"batch {args.batch}, FULL_SHARD, {args.nproc} ranks, torch {torch.__version__}, median of {args.steps} steps")
    print("| setting | step (s) | vs no prefetch |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.4f} | {seconds / base:.2f}x |")
    return 0
