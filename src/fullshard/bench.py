"""``fullshard bench``: timings of fullshard configurations on this machine, as ratios.

``fullshard bench optimizer [--numel 62000000]`` times one CPU AdamW step over one rank's shards
(the step that CPU offload moves to the host) for the for-loop, foreach and fused variants.

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
from collections.abc import Sequence
from typing import Any

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


def prefetch_worker(d: int, layers: int, batch: int, steps: int) -> list[tuple[str, float]] | None:
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


def optimizer_step_seconds(numel: int, steps: int = 5) -> list[tuple[str, float]]:
    """Median seconds of one AdamW step over ``numel`` fp32 elements in CPU shards, per variant.

    The shards are split like a transformer's (one large and a few small tensors per layer),
    which is what an offloaded FSDP run hands the optimizer on each rank.
    """
    torch.manual_seed(0)
    sizes = []
    left = numel
    while left > 0:
        for s in (min(left, 1 << 20), 1024, 1024):
            if left > 0:
                sizes.append(min(s, left))
                left -= sizes[-1]
    rows = []
    variants: list[tuple[str, dict[str, Any]]] = [("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})]
    for name, kwargs in variants:
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


# The GPT workloads of the comparison (issue "benchmarks against torch FSDP2 and DDP").
COMPARE_WORKLOADS: dict[str, dict[str, int]] = {
    "compute": {"d_model": 256, "n_layers": 4, "n_heads": 4, "vocab": 256, "batch": 8, "seq": 128},
    "memory": {"d_model": 1024, "n_layers": 8, "n_heads": 16, "vocab": 32000, "batch": 1, "seq": 16},
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 2, "vocab": 256, "batch": 2, "seq": 16},  # for tests
}
IMPLEMENTATIONS = ("fullshard", "torch FSDP2", "DDP")


def _wrap(impl: str, model: nn.Module) -> nn.Module:
    from fullshard.gpt import Block

    if impl == "fullshard":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    if impl == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            torch_fully_shard(block)
        return torch_fully_shard(model)  # type: ignore[return-value]
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _bytes_sent(impl: str, param_bytes: int, blocks: int, world: int) -> int:
    """Bytes one rank sends per step. fullshard's are counted; the peers' follow from their algorithms.

    DDP: a ring all-reduce of the gradients, 2 (N-1)/N x P. torch FSDP2 on gloo: all-gathers in
    forward and again in backward (the root stays gathered), (N-1)/N x P each, and its
    reduce-scatter, which torch runs on gloo as a full all-reduce, 2 (N-1)/N x P.
    """
    f = (world - 1) / world
    if impl == "DDP":
        return int(2 * f * param_bytes)
    return int((2 + 2) * f * param_bytes)


def compare_worker(workload: str, steps: int, warmup: int) -> dict[str, dict[str, Any]] | None:
    """One rank: every implementation in turn on the same model, data, seed and AdamW."""
    import gc

    from fullshard.gpt import GPT, GPTConfig
    from fullshard.memory import model_state_bytes, peak_rss_bytes, reset_peak_rss

    device = launch.init_process_group()
    torch.set_num_threads(1)
    w = COMPARE_WORKLOADS[workload]
    group = C.default_group()
    rank, world = C.group_rank(group), C.group_size(group)
    results: dict[str, dict[str, Any]] = {}
    try:
        for impl in IMPLEMENTATIONS:
            gc.collect()
            reset_peak_rss()
            torch.manual_seed(0)
            cfg = GPTConfig(d_model=w["d_model"], n_layers=w["n_layers"], n_heads=w["n_heads"], vocab_size=w["vocab"], max_seq_len=max(w["seq"], 16))
            model = _wrap(impl, GPT(cfg).to(device))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            g = torch.Generator().manual_seed(1 + rank)
            x = torch.randint(0, w["vocab"], (w["batch"], w["seq"]), generator=g, device=device)
            C.STATS.reset()
            times = []
            for i in range(warmup + steps):
                C.barrier(group)
                start = time.perf_counter()
                opt.zero_grad()
                logits = model(x)
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
                opt.step()
                elapsed = torch.tensor([time.perf_counter() - start])
                C.all_reduce_max(elapsed, group)
                if i >= warmup:
                    times.append(float(elapsed.item()))
                if i == warmup - 1:
                    C.STATS.reset()
            state = model_state_bytes(model, opt)
            counted = sum(C.STATS.bytes_sent.values()) // max(1, steps)
            sent = counted if impl == "fullshard" else _bytes_sent(impl, cfg.num_params * 4, cfg.n_layers, world)
            rss = C.all_gather_object(peak_rss_bytes(), group)
            results[impl] = {
                "step_s": statistics.median(times),
                "tokens_per_s": w["batch"] * w["seq"] * world / statistics.median(times),
                "peak_rss": max(rss),
                "state_bytes": state["total"],
                "bytes_sent": sent,
                "params": cfg.num_params,
            }
            del model, opt
        return results if rank == 0 else None
    finally:
        launch.destroy_process_group()


def compare_table(workload: str, results: dict[str, dict[str, Any]]) -> str:
    """A markdown table of the comparison, each figure with its ratios to torch FSDP2 and DDP."""
    fsdp2, ddp = results["torch FSDP2"], results["DDP"]

    def cell(impl: str, key: str, fmt: str) -> str:
        v = results[impl][key]
        return f"{fmt.format(v)} ({v / fsdp2[key]:.2f}x / {v / ddp[key]:.2f}x)"

    lines = [
        f"Workload `{workload}`: {COMPARE_WORKLOADS[workload]}, {results['DDP']['params'] / 1e6:.1f}M parameters. "
        "Cells: value (ratio to torch FSDP2 / ratio to DDP).",
        "",
        "| implementation | step (s) | tokens/s | peak RSS per rank (MiB) | model state per rank (MiB) | sent per step (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for impl in IMPLEMENTATIONS:
        r = results[impl]
        lines.append(
            f"| {impl} | {cell(impl, 'step_s', '{:.3f}')} | {cell(impl, 'tokens_per_s', '{:,.0f}')} | "
            f"{r['peak_rss'] / 2**20:,.0f} ({r['peak_rss'] / fsdp2['peak_rss']:.2f}x / {r['peak_rss'] / ddp['peak_rss']:.2f}x) | "
            f"{r['state_bytes'] / 2**20:,.1f} ({r['state_bytes'] / fsdp2['state_bytes']:.2f}x / {r['state_bytes'] / ddp['state_bytes']:.2f}x) | "
            f"{r['bytes_sent'] / 2**20:,.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fullshard bench``."""
    p = argparse.ArgumentParser(prog="fullshard bench", description=__doc__)
    p.add_argument("workload", choices=["prefetch", "optimizer", "compare"])
    p.add_argument("--compare", default="compute", choices=sorted(COMPARE_WORKLOADS), help="compare: the GPT workload")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--numel", type=int, default=62_000_000, help="optimizer: elements per rank")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.workload == "compare":
        import os

        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed blocks go back: fair peak RSS per implementation
        res = launch.launch(compare_worker, (args.compare, args.steps, args.warmup), args.nproc)[0]
        assert res is not None
        print(f"fullshard bench compare --compare {args.compare} --steps {args.steps}: {args.nproc} ranks, gloo, one thread "
              f"per rank, torch {torch.__version__}, median step after {args.warmup} warm-up steps")
        print(compare_table(args.compare, res))
        return 0
    if args.workload == "optimizer":
        torch.set_num_threads(1)
        opt_rows = optimizer_step_seconds(args.numel)
        print(f"CPU AdamW step over {args.numel / 1e6:.0f}M fp32 elements (one rank's shards), one thread, torch {torch.__version__}")
        print("| implementation | step (s) | vs for-loop |")
        print("|---|---|---|")
        for name, seconds in opt_rows:
            print(f"| {name} | {seconds:.3f} | {seconds / opt_rows[0][1]:.2f}x |")
        return 0
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
