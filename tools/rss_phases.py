"""Host memory per phase and rank for one `fullshard bench compare` workload (issue 33).

    python tools/rss_phases.py memory "fullshard,torch FSDP2" [steps]

For each implementation, in fresh worker processes with the benchmark's environment
(``launch.BENCH_ENV``): VmRSS after each phase (init, build, then per step: zero_grad, forward,
backward, optimizer step) and the peak (VmHWM) reached inside each phase (the count restarted
from the current RSS before it), plus the exact model-state bytes, the bytes fullshard's buffer
pool keeps, and glibc's heap figures (``mallinfo2``: bytes in use and free in the arenas, bytes in
mmapped chunks). In the last step of a fullshard implementation it also marks each engine event
(unshard, forward, backward, reduce of each unit, from :mod:`fullshard.probes`), which places the
peak. Rank 0 prints, all in MiB. RSS is not timing-sensitive; the step time printed is only a
sanity check.
"""

import ctypes
import sys
import time

import torch

from fullshard.comm import buffers, collectives
from fullshard.jobs import launch
from fullshard.jobs.bench import workloads
from fullshard.plan.memory import model_state_bytes, reset_peak_rss

MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


def heap() -> tuple[float, float, float]:
    """glibc: bytes in use in the arenas, free in the arenas, in mmapped chunks (MiB)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return (0.0, 0.0, 0.0)
    return (m.uordblks / MIB, m.fordblks / MIB, m.hblkhd / MIB)


def status() -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out["VmRSS"], out["VmHWM"]


class _Marks(list):
    """An event log that marks the RSS at each engine event (fullshard's probes)."""

    def __init__(self, mark):
        super().__init__()
        self.mark = mark

    def append(self, item):
        self.mark(f"  {item[0]} {item[1]}"[-30:])
        super().append(item)


def _events(mark, on):
    import contextlib

    from fullshard import probes

    if not on:
        return contextlib.nullcontext()
    cm = probes.enabled(events=True)

    @contextlib.contextmanager
    def wrapped():
        with cm as p:
            p.events = _Marks(mark)
            yield

    return wrapped()


def worker(workload, impl, steps):
    rows = []

    def mark(name, t=0.0):
        rss, hwm = status()
        rows.append((name, rss, hwm, buffers.POOL.nbytes / MIB, *heap(), t))
        reset_peak_rss()

    dev = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        g = collectives.default_group()
        mark("init")
        job = workloads.build_job(workload, impl, dev, collectives.group_rank(g))
        mark("build")
        for i in range(steps):
            collectives.barrier(g)
            reset_peak_rss()
            t0 = time.perf_counter()
            job.optimizer.zero_grad()
            mark(f"s{i} zero_grad")
            with _events(mark, i == steps - 1 and impl.startswith("fullshard")):
                loss = job.loss(job.model, job.batch)
                mark(f"s{i} forward")
                loss.backward()
            mark(f"s{i} backward")
            job.optimizer.step()
            mark(f"s{i} step", time.perf_counter() - t0)
        state = model_state_bytes(job.model, job.optimizer)
        all_rows = collectives.all_gather_object((rows, {k: v / MIB for k, v in state.items()}), g)
        return all_rows if collectives.group_rank(g) == 0 else None
    finally:
        launch.destroy_process_group()


if __name__ == "__main__":
    workload = sys.argv[1]
    impls = sys.argv[2].split(",")
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    for impl in impls:
        res = launch.launch(worker, (workload, impl, steps), 2, env=launch.BENCH_ENV)[0]
        for r, (rows, state) in enumerate(res):
            print(f"== {impl} rank {r}: model state " + ", ".join(f"{k} {v:.1f}" for k, v in state.items()))
            head = ("RSS", 7), ("peak in", 7), ("pool", 6), ("heap used", 9), ("heap free", 9), ("mmapped", 8)
            print(f"{'phase':30s} " + " ".join(f"{h:>{w}s}" for h, w in head))
            for name, rss, hwm, pool, used, free, mm, t in rows:
                extra = f"  step {t:.2f} s" if t else ""
                print(f"{name:30s} {rss:7.0f} {hwm:7.0f} {pool:6.0f} {used:9.0f} {free:9.0f} {mm:8.0f}{extra}")
            peak = max(h for _, _, h, *_ in rows)
            print(f"peak RSS {peak:.0f} MiB", flush=True)
