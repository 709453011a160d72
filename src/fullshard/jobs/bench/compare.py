"""``fullshard bench compare``: fullshard against torch FSDP2 and DDP on the same workloads.

Each turn (one implementation of one workload, :mod:`fullshard.jobs.bench.workloads`) runs in
freshly started worker processes and reports step time, CPU time, peak memory, model-state
bytes, full-parameter bytes gathered at the peak, and bytes sent per step. fullshard's gathered
and sent bytes are measured with :mod:`fullshard.probes`; the other implementations' come from
their schedules. :func:`run_compare` returns the markdown section: one table per workload, each
figure with its ratios to torch FSDP2 and to DDP, and issue 6's targets, met or not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from fullshard import probes
from fullshard.comm import collectives
from fullshard.jobs import launch
from fullshard.jobs.bench.report import machine_line
from fullshard.jobs.bench.workloads import (
    COMPARE_WORKLOADS,
    FLOOR,
    FULLY_SHARD,
    IMPLEMENTATIONS,
    QUANTIZED,
    Job,
    build_job,
    step,
)


def compare_worker(
    workload: str, impl: str, steps: int, warmup: int, comm_quant: str | None = None
) -> dict[str, Any] | None:
    """One rank, one implementation: build it from the seed, run ``warmup`` untimed and ``steps``
    timed steps; rank 0 returns the step times, the CPU seconds per step (user + system, all
    threads, mean over ranks), the peak RSS (or peak GPU memory) over ranks, the
    model-state bytes and the bytes sent per step. ``comm_quant``: the spec of :data:`QUANTIZED`.
    """
    device = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        result = _compare_turn(workload, impl, steps, warmup, device, comm_quant)
        return result if collectives.group_rank(collectives.default_group()) == 0 else None
    finally:
        launch.destroy_process_group()  # the job is out of scope here: its groups end now


def _compare_turn(
    workload: str, impl: str, steps: int, warmup: int, device: torch.device, comm_quant: str | None = None
) -> dict[str, Any]:
    """Build the job, measure it, and gather this rank's figures (see :func:`compare_worker`)."""
    from fullshard.plan.memory import model_state_bytes, peak_rss_bytes

    group = collectives.default_group()
    rank, world = collectives.group_rank(group), collectives.group_size(group)
    job = build_job(workload, impl, device, rank, comm_quant)
    times, cpu, sent, gathered = _measure(job, steps, warmup, device)
    state = model_state_bytes(job.model, job.optimizer)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_rss_bytes()
    peaks = collectives.all_gather_object(peak, group)
    cpus = collectives.all_gather_object(cpu, group)
    result = {
        "times": times,
        "cpu_times": [sum(c) / world for c in zip(*cpus)],  # CPU: mean over ranks, per step
        "peak_rss": max(peaks),
        "state_bytes": state["total"],
        "params": job.params,
        "gathered_bytes": gathered if impl.startswith("fullshard") else _gathered_peak(impl, job, world),
        "items": job.items * world,
        "largest_unit_bytes": job.largest_unit_bytes,
        "world": world,
        "device": str(device),
        "bytes_sent": sent if impl.startswith("fullshard") else _bytes_sent(impl, job.params * 4, world),
    }
    return result


def _measure(job: Job, steps: int, warmup: int, device: torch.device) -> tuple[list[float], list[float], int, int]:
    """Run ``warmup`` untimed and ``steps`` timed steps of ``job`` with the probes enabled.

    Returns the wall seconds of each timed step (as long as the slowest rank took), this rank's
    CPU seconds of each, the bytes this rank sent per timed step (fullshard's collectives, the
    timing's own max-reduction left out) and the peak bytes of full parameters gathered at once
    (fullshard's units, over all steps).
    """
    group = collectives.default_group()
    times, cpu = [], []
    with probes.enabled() as p:
        for i in range(warmup + steps):
            if i == warmup:
                p.collectives.reset()
            collectives.barrier(group)
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            step(job)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], device=device)
            spent = _cpu_seconds() - cpu_start
            collectives.all_reduce_max(elapsed, group)
            if i >= warmup:
                times.append(float(elapsed.item()))
                cpu.append(spent)
        p.collectives.bytes_sent.pop("all_reduce", None)  # the timing's own max-reduction
        return times, cpu, sum(p.collectives.bytes_sent.values()) // steps, p.gathered.peak_bytes


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads (gloo's included)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _gathered_peak(impl: str, job: Job, world: int) -> int:
    """Full-parameter bytes a peer holds at its peak beyond its sharded state, from its schedule.

    torch FSDP2 keeps the root's parameters gathered through forward and backward and
    prefetches one unit ahead: root + the two largest other units. DDP and the floor hold
    full parameters as their state: 0.
    """
    if impl != "torch FSDP2":
        return 0
    units = sorted(
        (
            sum(p.numel() * p.element_size() for p in m.parameters())  # DTensor numel: global
            for m in job.model.modules()
            if m is not job.model and hasattr(m, "unshard")
        ),
        reverse=True,
    )
    root = job.params * 4 - sum(units)
    return root + sum(units[:2])


def _bytes_sent(impl: str, param_bytes: int, world: int) -> int:
    """Bytes one rank sends per step, for the peers (fullshard's are counted by its collectives).

    DDP: a ring all-reduce of the gradients, 2 (N-1)/N x P. torch FSDP2 on gloo: all-gathers in
    forward and again in backward, (N-1)/N x P each, and its reduce-scatter, which torch runs on
    gloo as a full all-reduce, 2 (N-1)/N x P. No communication: 0.
    """
    f = (world - 1) / world
    return {"DDP": int(2 * f * param_bytes), "torch FSDP2": int(4 * f * param_bytes)}.get(impl, 0)


def _items_name(workload: str) -> str:
    return "samples" if workload == "mnist" else "tokens"


def compare_table(workload: str, results: dict[str, dict[str, Any]]) -> str:
    """A markdown table of one workload, each figure with its ratios to torch FSDP2 and to DDP."""
    fsdp2, ddp = results["torch FSDP2"], results["DDP"]
    any_r = results["fullshard"]
    items = _items_name(workload)
    on_gpu = any_r["device"].startswith("cuda")

    def ratio(impl: str, key: str) -> str:
        v = results[impl][key]
        a = v / fsdp2[key] if fsdp2[key] else float("nan")
        b = v / ddp[key] if ddp[key] else float("nan")
        return f"{a:.2f}x / {b:.2f}x"

    mem = "peak GPU memory" if on_gpu else "peak RSS"
    lines = [
        f"Workload `{workload}`: {COMPARE_WORKLOADS[workload]}, {any_r['params'] / 1e6:.1f}M parameters, "
        f"{any_r['world']} ranks. Cells: value (ratio to torch FSDP2 / ratio to DDP).",
        "",
        f"| implementation | step (s) | CPU per step per rank (s) | {items}/s | {mem} per rank (MiB) | "
        "model state per rank (MiB) "
        "| of which gathered at peak (MiB) | sent per step (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        r["model_state"] = r["state_bytes"] + r["gathered_bytes"]
    for impl in row_order(results):
        r = results[impl]
        state = r["model_state"]
        lines.append(
            f"| {impl} | {r['step_s']:.3f} ({ratio(impl, 'step_s')}) | {r['cpu_s']:.3f} | "
            f"{r['items_per_s']:,.0f} ({ratio(impl, 'items_per_s')}) | "
            f"{r['peak_rss'] / 2**20:,.0f} ({ratio(impl, 'peak_rss')}) | {state / 2**20:,.1f} "
            f"({ratio(impl, 'model_state')}) | "
            f"{r['gathered_bytes'] / 2**20:,.1f} | {r['bytes_sent'] / 2**20:,.1f} |"
        )
    quant = results.get(QUANTIZED)
    if quant is not None:
        lines += ["", f"`{QUANTIZED}`: the FSDP1 wrapper with `--comm-quant {quant['comm_quant']}`."]
    return "\n".join(lines)


def row_order(results: dict[str, Any]) -> list[str]:
    """The implementations of ``results`` in table order (the quantized row after fullshard's)."""
    order = ("fullshard", QUANTIZED, *IMPLEMENTATIONS[1:], FLOOR)
    return [impl for impl in order if impl in results]


def target_lines(workload: str, results: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 6's targets for ``workload``, each with the measured value and met / not met."""
    fs, fsdp2, ddp = results["fullshard"], results["torch FSDP2"], results["DDP"]
    checks: list[tuple[str, float, float]] = []
    if workload == "compute":
        checks += [
            ("step vs torch FSDP2", fs["step_s"] / fsdp2["step_s"], 0.75),
            ("step vs DDP", fs["step_s"] / ddp["step_s"], 1.05),
        ]
    if workload == "memory":
        checks += [
            ("step vs torch FSDP2", fs["step_s"] / fsdp2["step_s"], 0.6),
            ("peak RSS vs torch FSDP2", fs["peak_rss"] / fsdp2["peak_rss"], 1.0),
        ]
    two = results.get(FULLY_SHARD)
    if two is not None:  # issue 13: DTensor parameters must not give back what the engine won
        if workload == "memory":
            checks.append(("fully_shard step vs torch FSDP2", two["step_s"] / fsdp2["step_s"], 0.6))
        checks.append(("fully_shard step vs the FSDP1 wrapper's", two["step_s"] / fs["step_s"], 1.05))
    quant = results.get(QUANTIZED)
    if quant is not None:  # issue 33
        checks.append(("issue 33: quantized bytes sent vs fullshard's", quant["bytes_sent"] / fs["bytes_sent"], 0.35))
        if workload == "memory":
            checks.append(("issue 33: quantized step vs DDP", quant["step_s"] / ddp["step_s"], 0.6))
    bound = 16 * fs["params"] / fs["world"] + fs["largest_unit_bytes"]
    if workload != "mnist":  # Adadelta keeps two state tensors too, but the bound is stated for AdamW
        checks.append(
            ("model state vs 16 B x P / N + largest unit", (fs["state_bytes"] + fs["gathered_bytes"]) / bound, 1.0)
        )
    if not checks:
        return ["- none for this workload"]
    return [
        f"- {name}: {value:.2f}x (target at most {limit}x): {'met' if value <= limit else 'not met'}"
        for name, value, limit in checks
    ]


def run_compare(
    workloads: Sequence[str], steps: int, warmup: int, rounds: int, nproc: int, comm_quant: str | None = None
) -> tuple[str, dict[str, Any]]:
    """Run every workload; return the markdown section and the results per workload.

    Args:
        workloads: keys of :data:`~fullshard.jobs.bench.workloads.COMPARE_WORKLOADS`.
        steps, warmup: timed and untimed steps per turn.
        rounds: turns per implementation.
        nproc: ranks (worker processes) per turn.
        comm_quant: a quantization spec (as the jobs' ``--comm-quant``): adds the row
            :data:`~fullshard.jobs.bench.workloads.QUANTIZED`; None: no such row.
    """
    all_results: dict[str, dict[str, Any]] = {}
    parts = []
    for workload in workloads:
        res = _run_workload(workload, steps, warmup, rounds, nproc, comm_quant)
        all_results[workload] = res
        parts += [compare_table(workload, res), "", "Against issue 6's targets:", *target_lines(workload, res), ""]
    device = next(iter(all_results.values()))["fullshard"]["device"]
    backend = "NCCL" if device.startswith("cuda") else "gloo"
    head = [
        f"Machine: {machine_line(device)}; {nproc} ranks, {backend}, one compute thread per rank; "
        f"median of {steps * rounds} timed steps per implementation ({rounds} turns of {warmup} warm-up + "
        f"{steps} timed "
        "steps, each turn in fresh processes, the order reversed every other round).",
        "",
    ]
    return "\n".join(head + parts), all_results


def _run_workload(
    workload: str, steps: int, warmup: int, rounds: int, nproc: int, comm_quant: str | None = None
) -> dict[str, dict[str, Any]]:
    """Every implementation's figures on ``workload``, its step and CPU times as medians.

    Each turn (one implementation) runs in freshly started worker processes, so its peak RSS is
    its own and no allocator state carries over; ``rounds`` turns per implementation, the order
    reversed every other round, so drift in the machine's speed hits all of them alike.
    """
    impls = (*IMPLEMENTATIONS, FLOOR) + ((QUANTIZED,) if comm_quant is not None else ())
    res: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            args = (workload, impl, steps, warmup, comm_quant if impl == QUANTIZED else None)
            turn = launch.launch(compare_worker, args, nproc, env=launch.BENCH_ENV)[0]
            assert turn is not None
            if impl == QUANTIZED:
                turn["comm_quant"] = comm_quant
            if impl in res:
                res[impl]["times"] += turn["times"]
                res[impl]["cpu_times"] += turn["cpu_times"]
                res[impl]["peak_rss"] = max(res[impl]["peak_rss"], turn["peak_rss"])
            else:
                res[impl] = turn
    for one in res.values():
        one["step_s"] = statistics.median(one.pop("times"))
        one["cpu_s"] = statistics.median(one.pop("cpu_times"))
        one["items_per_s"] = one["items"] / one["step_s"]
    return res
