"""Step times of several implementations of one `fullshard bench compare` workload taking turns
step by step in one process group (2 ranks), so that the machine's drift over minutes (which
moves a quiet run's DDP step by 10% here) falls on all of them alike.

    python tools/interleave.py compute "DDP;fullshard" 40
    python tools/interleave.py compute 'DDP;fullshard;fullshard:{"forward_prefetch": true}' 40

Implementations are separated by ";"; each is a name of ``workloads.IMPLEMENTATIONS`` (or the floor), optionally
followed by ``:`` and a JSON object of extra keyword arguments for fullshard's wrapper
(``"keep_last": false`` turns off ``hooks.KEEP_LAST_GATHERED`` for that implementation's steps,
``"root_prefetch": false`` turns off ``hooks.ROOT_BACKWARD_PREFETCH`` (switches alone apply to
any implementation, ``fully_shard`` too),
``"own_rows_direct": false`` turns off ``unit.OWN_ROWS_DIRECT``, ``"forward_prefetch_depth": N``
makes each unit's forward start the all-gathers of the next N units in module order,
``"local_gather": true`` is a diagnosis, not training: every all-gather of that implementation's
steps stays on its rank (each rank's own shard is copied into every rank's slice, so the values
are wrong but finite), so its step shows what the engine costs without the wire),
or ``fullshard quantized=SPEC``: the wrapper with ``--comm-quant SPEC`` (as ``bench compare``'s row),
or ``torch FSDP1``: torch's own FullyShardedDataParallel over the same units (on CPU with
``device_id``).

    python tools/interleave.py memory "DDP;fullshard;fullshard quantized=on" 6

Prints, per implementation, the median step (wall seconds as long as the slowest rank took),
the median over rounds of its step divided by the first implementation's step of the same
round, the 25th-75th percentiles of that ratio, and rank 0's median forward (with the loss),
backward and optimizer step: wall time, then the CPU time of rank 0's main thread in the same
phases (``time.thread_time``: the model's compute, autograd, the engine's hooks and copies, and
issuing collectives; not gloo's own threads, not time blocked in a wait).
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
SWITCHES = {
    "keep_last": (hooks, "KEEP_LAST_GATHERED"),
    "own_rows_direct": (unit, "OWN_ROWS_DIRECT"),
    "root_prefetch": (hooks, "ROOT_BACKWARD_PREFETCH"),
}

_all_gather = collectives.all_gather
_LOCAL_GATHER = [False]  # the "local_gather" switch of the implementation taking its turn


def _gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: collectives.ProcessGroup,
    async_op: bool = False,
    fill_own: bool = True,
) -> collectives.Handle | None:
    """``collectives.all_gather``, or under ``"local_gather"`` the same copies without the wire:
    this rank's shard into every other rank's slice (and its own, as ``fill_own`` asks)."""
    if not _LOCAL_GATHER[0]:
        return _all_gather(output, input, group, async_op=async_op, fill_own=fill_own)
    me, slices = collectives.group_rank(group), output.view(collectives.group_size(group), -1)
    for r, part in enumerate(slices):
        if r != me or fill_own:
            part.copy_(input)
    return collectives.Handle(None) if async_op else None


collectives.all_gather = _gather  # the engine calls it through the module


def _build(workload: str, spec: str, dev: torch.device, rank: int) -> workloads.Job:
    name, _, kw_text = spec.partition(":")
    if name.startswith(workloads.QUANTIZED + "="):
        return workloads.build_job(workload, workloads.QUANTIZED, dev, rank, name.partition("=")[2])
    if name == TORCH_FSDP1:
        return _torch_fsdp1_job(workload, dev, rank)
    if not kw_text:
        return workloads.build_job(workload, name, dev, rank)
    kw = json.loads(kw_text)
    for key in (*SWITCHES, "local_gather"):
        kw.pop(key, None)
    depth = kw.pop("forward_prefetch_depth", 0)
    if not kw and not depth:  # switches only: the implementation as named (fully_shard too)
        return workloads.build_job(workload, name, dev, rank)
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


TORCH_FSDP1 = "torch FSDP1"  # torch's own FullyShardedDataParallel, on CPU through device_id


def _torch_fsdp1_job(workload: str, dev: torch.device, rank: int) -> workloads.Job:
    """The workload under torch's FSDP1 wrapper, the same units as fullshard's wrapper
    (``use_orig_params=True``, BACKWARD_PRE; on CPU torch's FSDP1 needs ``device_id``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    orig = workloads.wrap

    def _wrap(impl, model, units, device, comm_quant=None):  # type: ignore[no-untyped-def]
        chosen = {id(u) for u in units}

        def policy(module, recurse, nonwrapped_numel):  # type: ignore[no-untyped-def]
            return recurse or id(module) in chosen

        return TorchFSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=device)

    workloads.wrap = _wrap  # type: ignore[assignment]
    try:
        return workloads.build_job(workload, "fullshard", dev, rank)
    finally:
        workloads.wrap = orig  # type: ignore[assignment]


Phases = list[list[tuple[float, ...]]]  # per implementation, per round: 3 wall, then 3 CPU seconds


def worker(workload: str, specs: list[str], rounds: int, warmup: int) -> tuple[list[list[float]], Phases] | None:
    dev = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        g = collectives.default_group()
        rank = collectives.group_rank(g)
        jobs = [_build(workload, s, dev, rank) for s in specs]
        switches = [json.loads(s.partition(":")[2] or "{}") for s in specs]
        times: list[list[float]] = [[] for _ in specs]
        phases: Phases = [[] for _ in specs]
        for r in range(warmup + rounds):
            for i, job in enumerate(jobs):
                for key, (module, name) in SWITCHES.items():
                    setattr(module, name, switches[i].get(key, True))
                _LOCAL_GATHER[0] = bool(switches[i].get("local_gather", False))
                collectives.barrier(g)
                t0, c0 = time.perf_counter(), time.thread_time()
                job.optimizer.zero_grad()
                loss = job.loss(job.model, job.batch)
                t1, c1 = time.perf_counter(), time.thread_time()
                loss.backward()
                t2, c2 = time.perf_counter(), time.thread_time()
                job.optimizer.step()
                t3, c3 = time.perf_counter(), time.thread_time()
                elapsed = torch.tensor([t3 - t0])
                collectives.all_reduce_max(elapsed, g)
                if r >= warmup:
                    times[i].append(float(elapsed.item()))
                    phases[i].append((t1 - t0, t2 - t1, t3 - t2, c1 - c0, c2 - c1, c3 - c2))
        return (times, phases) if rank == 0 else None
    finally:
        launch.destroy_process_group()


def main() -> None:
    workload, specs = sys.argv[1], sys.argv[2].split(";")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    times, phases = launch.launch(worker, (workload, specs, rounds, 3), 2)[0]
    base = times[0]
    for spec, t, ph in zip(specs, times, phases):
        fwd, bwd, opt, cpu_fwd, cpu_bwd, cpu_opt = (statistics.median(c) * 1e3 for c in zip(*ph))
        ratios = sorted(a / b for a, b in zip(t, base))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"{spec:40s} median step {statistics.median(t) * 1e3:7.1f} ms | "
            f"vs {specs[0]}: median {q[1]:.3f}x (p25 {q[0]:.3f}, p75 {q[2]:.3f}) | rank 0 forward "
            f"{fwd:.1f}, backward {bwd:.1f}, optimizer {opt:.1f} ms; main-thread CPU {cpu_fwd:.1f}, {cpu_bwd:.1f}, "
            f"{cpu_opt:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
