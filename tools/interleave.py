"""Step times of several implementations of one `fullshard bench compare` workload taking turns
step by step in one process group (2 ranks), so that the machine's drift over minutes (which
moves a quiet run's DDP step by 10% here) falls on all of them alike.

    python tools/interleave.py compute "DDP;fullshard" 40
    python tools/interleave.py compute 'DDP;fullshard;fullshard:{"forward_prefetch": true}' 40

Implementations are separated by ";"; each is a name of ``workloads.IMPLEMENTATIONS`` (or the floor), optionally
followed by ``:`` and a JSON object of extra keyword arguments for fullshard's wrapper
(``"keep_last": false`` turns off ``hooks.KEEP_LAST_GATHERED`` for that implementation's steps,
``"own_rows_direct": false`` turns off ``unit.OWN_ROWS_DIRECT``, ``"forward_prefetch_depth": N``
makes each unit's forward start the all-gathers of the next N units in module order),
or ``fullshard quantized=SPEC``: the wrapper with ``--comm-quant SPEC`` (as ``bench compare``'s row).

    python tools/interleave.py memory "DDP;fullshard;fullshard quantized=on" 6

Prints, per implementation, the median step (wall seconds as long as the slowest rank took),
the median over rounds of its step divided by the first implementation's step of the same
round, the 25th-75th percentiles of that ratio, and rank 0's median forward (with the loss),
backward and optimizer step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from fullshard.comm import collectives
from fullshard.engine import hooks, unit
from fullshard.jobs import launch
from fullshard.jobs.bench import workloads

# Engine switches an implementation's JSON may turn off for its own steps: key -> (module, name).
SWITCHES = {"keep_last": (hooks, "KEEP_LAST_GATHERED"), "own_rows_direct": (unit, "OWN_ROWS_DIRECT")}


def _build(workload: str, spec: str, dev: torch.device, rank: int) -> workloads.Job:
    name, _, kw_text = spec.partition(":")
    if name.startswith(workloads.QUANTIZED + "="):
        return workloads.build_job(workload, workloads.QUANTIZED, dev, rank, name.partition("=")[2])
    if not kw_text:
        return workloads.build_job(workload, name, dev, rank)
    kw = json.loads(kw_text)
    for key in SWITCHES:
        kw.pop(key, None)
    depth = kw.pop("forward_prefetch_depth", 0)
    from fullshard import BackwardPrefetch
    from fullshard import FullyShardedDataParallel as FSDP

    if "backward_prefetch" in kw and kw["backward_prefetch"] is not None:
        kw["backward_prefetch"] = BackwardPrefetch[kw["backward_prefetch"]]
    orig = workloads.wrap

    def _wrap(impl, model, units, device, comm_quant=None):  # type: ignore[no-untyped-def]
        chosen = {id(u) for u in units}

        def policy(module, recurse, nonwrapped_numel):  # type: ignore[no-untyped-def]
            return recurse or id(module) in chosen

        return FSDP(model, auto_wrap_policy=policy, **kw)

    workloads.wrap = _wrap  # type: ignore[assignment]
    try:
        job = workloads.build_job(workload, name, dev, rank)
    finally:
        workloads.wrap = orig  # type: ignore[assignment]
    if depth:  # each unit's forward starts the all-gathers of the next ``depth`` units
        states = [hooks.fsdp_state(m) for m in FSDP.fsdp_modules(job.model)]
        for i, st in enumerate(states):
            st.prefetch_in_forward = [o.unit for o in states[i + 1 : i + 1 + depth]]  # type: ignore[union-attr]
    return job


def worker(
    workload: str, specs: list[str], rounds: int, warmup: int
) -> tuple[list[list[float]], list[list[tuple[float, float, float]]]] | None:
    dev = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        g = collectives.default_group()
        rank = collectives.group_rank(g)
        jobs = [_build(workload, s, dev, rank) for s in specs]
        switches = [json.loads(s.partition(":")[2] or "{}") for s in specs]
        times: list[list[float]] = [[] for _ in specs]
        phases: list[list[tuple[float, float, float]]] = [[] for _ in specs]
        for r in range(warmup + rounds):
            for i, job in enumerate(jobs):
                for key, (module, name) in SWITCHES.items():
                    setattr(module, name, switches[i].get(key, True))
                collectives.barrier(g)
                t0 = time.perf_counter()
                job.optimizer.zero_grad()
                loss = job.loss(job.model, job.batch)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                job.optimizer.step()
                t3 = time.perf_counter()
                elapsed = torch.tensor([t3 - t0])
                collectives.all_reduce_max(elapsed, g)
                if r >= warmup:
                    times[i].append(float(elapsed.item()))
                    phases[i].append((t1 - t0, t2 - t1, t3 - t2))
        return (times, phases) if rank == 0 else None
    finally:
        launch.destroy_process_group()


def main() -> None:
    workload, specs = sys.argv[1], sys.argv[2].split(";")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    times, phases = launch.launch(worker, (workload, specs, rounds, 3), 2)[0]
    base = times[0]
    for spec, t, ph in zip(specs, times, phases):
        fwd, bwd, opt = (statistics.median(c) * 1e3 for c in zip(*ph))
        ratios = sorted(a / b for a, b in zip(t, base))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"{spec:40s} median step {statistics.median(t) * 1e3:7.1f} ms | "
            f"vs {specs[0]}: median {q[1]:.3f}x (p25 {q[0]:.3f}, p75 {q[2]:.3f}) | rank 0 forward "
            f"{fwd:.1f}, backward {bwd:.1f}, optimizer {opt:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
