"""The micro benchmarks: ``fullshard bench prefetch`` and ``fullshard bench optimizer``.

- prefetch: a stack of large Linear layers (communication-heavy: many parameters, small batch)
  trained with FULL_SHARD under each prefetch setting, the settings taking turns step by step;
  the median step time of each, with its ratio to the no-prefetch run.
- optimizer: one CPU AdamW step over one rank's shards (the step that CPU offload moves to the
  host) for the for-loop, foreach and fused variants.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine.config import BackwardPrefetch
from fullshard.frontend.fsdp1 import FullyShardedDataParallel as FSDP
from fullshard.frontend.wrap import ModuleWrapPolicy
from fullshard.jobs import launch

PREFETCH_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("no prefetch", {"backward_prefetch": None, "forward_prefetch": False}),
    ("BACKWARD_POST", {"backward_prefetch": BackwardPrefetch.BACKWARD_POST, "forward_prefetch": False}),
    ("BACKWARD_PRE", {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": False}),
    ("BACKWARD_PRE + forward_prefetch", {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": True}),
]
OPTIMIZER_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("for-loop", {"foreach": False}),
    ("foreach", {"foreach": True}),
    ("fused", {"fused": True}),
]


class _Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def _timed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """Seconds of one training step, as long as the slowest rank took."""
    group = collectives.default_group()
    collectives.barrier(group)
    start = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    collectives.all_reduce_max(elapsed, group)
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


def prefetch_worker(d: int, layers: int, batch: int, steps: int) -> list[tuple[str, float]] | None:
    """One rank: median step seconds of each prefetch setting (rank 0 returns them)."""
    device = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        rows = _prefetch_rows(device, d, layers, batch, steps)
        return rows if collectives.group_rank(collectives.default_group()) == 0 else None
    finally:
        launch.destroy_process_group()  # the models are out of scope here: their groups end now


def _prefetch_rows(device: torch.device, d: int, layers: int, batch: int, steps: int) -> list[tuple[str, float]]:
    models = []
    for _, kwargs in PREFETCH_CONFIGS:
        torch.manual_seed(0)
        stack = nn.Sequential(*[_Layer(d) for _ in range(layers)]).to(device)
        models.append(FSDP(stack, auto_wrap_policy=ModuleWrapPolicy({_Layer}), **kwargs))
    x = torch.randn(batch, d, device=device)
    medians = interleaved_medians(models, x, steps)
    return [(name, t) for (name, _), t in zip(PREFETCH_CONFIGS, medians)]


def prefetch_report(d_model: int, layers: int, batch: int, steps: int, nproc: int) -> list[str]:
    """Run the prefetch benchmark on ``nproc`` ranks; its heading and markdown table, as lines."""
    rows = launch.launch(prefetch_worker, (d_model, layers, batch, steps), nproc, env=launch.BENCH_ENV)[0]
    assert rows is not None
    base = rows[0][1]
    params = layers * (d_model**2 + d_model)
    return [
        f"prefetch benchmark: {layers} x Linear({d_model}, {d_model}) ({params / 1e6:.1f}M params), "
        f"batch {batch}, FULL_SHARD, {nproc} ranks, torch {torch.__version__}, median of {steps} steps",
        "| setting | step (s) | vs no prefetch |",
        "|---|---|---|",
        *(f"| {name} | {seconds:.4f} | {seconds / base:.2f}x |" for name, seconds in rows),
    ]


def _shard_sizes(numel: int) -> list[int]:
    """``numel`` elements split like a transformer's shards: one large and two small per layer."""
    sizes = []
    left = numel
    while left > 0:
        for s in (min(left, 1 << 20), 1024, 1024):
            if left > 0:
                sizes.append(min(s, left))
                left -= sizes[-1]
    return sizes


def optimizer_step_seconds(numel: int, steps: int = 5) -> list[tuple[str, float]]:
    """Median seconds of one AdamW step over ``numel`` fp32 elements in CPU shards, per variant.

    The shards are split like a transformer's (one large and a few small tensors per layer),
    which is what an offloaded FSDP run hands the optimizer on each rank.
    """
    torch.manual_seed(0)
    sizes = _shard_sizes(numel)
    rows = []
    for name, kwargs in OPTIMIZER_VARIANTS:
        params = [nn.Parameter(torch.randn(s)) for s in sizes]
        for q in params:
            q.grad = torch.randn_like(q)
        opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
        opt.step()  # creates the state
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        rows.append((name, statistics.median(times)))
    return rows


def optimizer_report(numel: int) -> list[str]:
    """Time the optimizer variants on one thread; their heading and markdown table, as lines."""
    torch.set_num_threads(1)
    rows = optimizer_step_seconds(numel)
    return [
        f"CPU AdamW step over {numel / 1e6:.0f}M fp32 elements (one rank's shards), one thread, "
        f"torch {torch.__version__}",
        "| implementation | step (s) | vs for-loop |",
        "|---|---|---|",
        *(f"| {name} | {seconds:.3f} | {seconds / rows[0][1]:.2f}x |" for name, seconds in rows),
    ]
