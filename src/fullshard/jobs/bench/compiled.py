"""``fullshard bench compile``: step time with and without torch.compile, fullshard against torch FSDP2.

Both FSDP2 front ends (fullshard's ``fully_shard`` and torch's) shard the same workload the same
way (:func:`~fullshard.jobs.bench.workloads.wrap`: each transformer block a unit, then the
root); the compiled variant then compiles each block with ``block.compile(backend=...)``, as
torchtitan does. Each turn runs in fresh worker processes: ``warmup`` untimed steps (the first
one compiles, so warm-up must be at least 2: forward and backward graphs), then ``steps`` timed
ones; the step time is the median, over turns, of the slowest rank's wall time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from fullshard import compat
from fullshard.comm import collectives
from fullshard.jobs import launch
from fullshard.jobs.bench.report import machine_line
from fullshard.jobs.bench.workloads import COMPARE_WORKLOADS, FULLY_SHARD, build_job, step, unit_modules

IMPLS = (FULLY_SHARD, "torch FSDP2")


def compile_worker(workload: str, impl: str, backend: str | None, steps: int, warmup: int) -> dict[str, Any] | None:
    """One rank of one turn: build ``impl`` on ``workload``, compile its blocks with ``backend``
    (None: eager), run ``warmup`` + ``steps`` steps; rank 0 returns the timed steps' seconds
    (the slowest rank's each), the warm-up seconds, and the graph breaks dynamo counted."""
    device = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        group = collectives.default_group()
        job = build_job(workload, impl, device, collectives.group_rank(group))
        if backend is not None:
            compat.dynamo_reset()
            for block in unit_modules(workload, job.model):
                block.compile(backend=backend)
        times, start = [], time.perf_counter()
        for i in range(warmup + steps):
            if i == warmup:
                warm = time.perf_counter() - start
            collectives.barrier(group)
            t0 = time.perf_counter()
            step(job)
            elapsed = torch.tensor([time.perf_counter() - t0])
            collectives.all_reduce_max(elapsed, group)
            times.append(float(elapsed.item()))
        breaks = 0
        if backend is not None:
            breaks = compat.dynamo_graph_breaks()
        if collectives.group_rank(group) != 0:
            return None
        return {"times": times[warmup:], "warmup_s": warm, "graph_breaks": breaks, "device": str(device)}
    finally:
        launch.destroy_process_group()


def run(workload: str, backend: str, steps: int, warmup: int, rounds: int, nproc: int) -> str:
    """Time both front ends eager and compiled on ``workload``; the markdown section.

    Raises:
        ValueError: ``warmup`` < 2 (the compiled turn would time its own compilation).
    """
    if warmup < 2:
        raise ValueError(f"fullshard bench compile: --warmup {warmup} would time compilation; use 2 or more")
    variants = [(impl, b) for impl in IMPLS for b in (None, backend)]
    times: dict[tuple[str, str | None], list[float]] = {v: [] for v in variants}
    info: dict[tuple[str, str | None], dict[str, Any]] = {}
    for r in range(rounds):
        for impl, b in variants if r % 2 == 0 else variants[::-1]:
            turn = launch.launch(compile_worker, (workload, impl, b, steps, warmup), nproc, env=launch.BENCH_ENV)[0]
            assert turn is not None
            times[(impl, b)] += turn.pop("times")
            info[(impl, b)] = turn
    step_s = {v: statistics.median(t) for v, t in times.items()}
    w = COMPARE_WORKLOADS[workload]
    lines = [
        f"Machine: {machine_line(info[variants[0]]['device'])}; {nproc} ranks, gloo, one compute thread per rank; "
        f"workload `{workload}` ({w}); median of {steps * rounds} timed steps per row ({rounds} turns of "
        f"{warmup} warm-up + {steps} timed steps, fresh processes each). Compiled: `block.compile(backend="
        f'"{backend}")` on every block after fully_shard.',
        "",
        "| implementation | eager step (s) | compiled step (s) | compiled / eager | graph breaks | warm-up with "
        "compilation (s) |",
        "|---|---|---|---|---|---|",
    ]
    for impl in IMPLS:
        eager, comp = step_s[(impl, None)], step_s[(impl, backend)]
        c = info[(impl, backend)]
        lines.append(
            f"| {impl} | {eager:.4f} | {comp:.4f} | {comp / eager:.2f}x | {c['graph_breaks']} | {c['warmup_s']:.1f} |"
        )
    ours, theirs = step_s[(FULLY_SHARD, backend)], step_s[("torch FSDP2", backend)]
    lines += [
        "",
        f"- compiled fullshard vs compiled torch FSDP2: {ours / theirs:.2f}x",
        f"- compile makes fullshard {'faster' if ours < step_s[(FULLY_SHARD, None)] else 'NOT faster'}",
    ]
    return "\n".join(lines)
