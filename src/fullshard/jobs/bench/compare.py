"""``fullshard bench``: timings of fullshard configurations on this machine, as ratios.

``fullshard bench optimizer [--numel 62000000]`` times one CPU AdamW step over one rank's shards
(the step that CPU offload moves to the host) for the for-loop, foreach and fused variants.

``fullshard bench gpu`` measures the GPT presets on one CUDA device (see :mod:`fullshard.bench_gpu`).

``fullshard bench prefetch [--nproc 2] [--steps 12]`` trains a stack of large Linear layers
(communication-heavy: many parameters, small batch) with FULL_SHARD under each prefetch setting
and prints the median step time of each, with its ratio to the no-prefetch run. Timings belong
here and in BENCHMARKS.md, never in test assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
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
    variants: list[tuple[str, dict[str, Any]]] = [
        ("for-loop", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ]
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


# The workloads of the comparison (issue "benchmarks against torch FSDP2 and DDP").
COMPARE_WORKLOADS: dict[str, dict[str, Any]] = {
    "compute": {"d_model": 256, "n_layers": 4, "n_heads": 4, "vocab": 256, "batch": 8, "seq": 128, "tied": True},
    "memory": {"d_model": 1024, "n_layers": 8, "n_heads": 16, "vocab": 32000, "batch": 1, "seq": 16, "tied": False},
    "mnist": {"batch": 64},  # the tutorial's CNN on the bundled MNIST images, Adadelta
    "tiny": {
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 2,
        "vocab": 256,
        "batch": 2,
        "seq": 16,
        "tied": True,
    },  # for tests
}
FULLY_SHARD = "fullshard fully_shard"  # the FSDP2 front end: DTensor parameters, torch's optimizer on them
IMPLEMENTATIONS = ("fullshard", FULLY_SHARD, "torch FSDP2", "DDP")
FLOOR = "no communication"  # each rank trains its own replica: the compute and optimizer floor
# Every implementation's workers run with huge pages for large CPU tensors (unless the caller's
# environment says otherwise): torch FSDP2 allocates fresh full-parameter buffers every step and
# its memory-bound step is 1.65x longer without them; fullshard reuses its buffers either way.
BENCH_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
BEGIN_MARK = "<!-- fullshard bench compare: begin (generated; edits are overwritten) -->"
END_MARK = "<!-- fullshard bench compare: end -->"


@dataclasses.dataclass
class _Job:
    """One implementation of a workload on this rank, ready to step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    items: int  # tokens or samples per rank per step
    params: int
    largest_unit_bytes: int


def _units(workload: str, model: nn.Module) -> list[nn.Module]:
    """The modules each FSDP implementation wraps as units below the root, outermost last."""
    if workload == "mnist":
        return [model.fc1]  # type: ignore[list-item]  # what the tutorial's size policy (20k) picks
    return list(model.blocks)  # type: ignore[arg-type]


def _build_job(workload: str, impl: str, device: torch.device, rank: int) -> _Job:
    """Build the model, wrap it for ``impl``, and make its optimizer and this rank's batch."""
    import torch.nn.functional as F

    w = COMPARE_WORKLOADS[workload]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + rank)
    model: nn.Module
    if workload == "mnist":
        from fullshard.jobs.data import mnist as mnist_data
        from fullshard.jobs.models.net import Net

        model = Net().to(device)
        train, _ = mnist_data.load_bundled()
        idx = torch.randperm(len(train), generator=g)[: w["batch"]]
        x, y = train[idx]
        batch = (x.to(device), y.to(device))

        def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return F.nll_loss(m(b[0]), b[1])

        items = w["batch"]
    else:
        from fullshard.jobs.models.gpt import GPT, GPTConfig

        cfg = GPTConfig(
            d_model=w["d_model"],
            n_layers=w["n_layers"],
            n_heads=w["n_heads"],
            vocab_size=w["vocab"],
            max_seq_len=max(w["seq"], 16),
            tie_embeddings=w["tied"],
        )
        model = GPT(cfg).to(device)
        tokens = torch.randint(0, w["vocab"], (w["batch"], w["seq"] + 1), generator=g).to(device)
        batch = (tokens[:, :-1], tokens[:, 1:])

        def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return F.cross_entropy(m(b[0]).float().flatten(0, 1), b[1].flatten())

        items = w["batch"] * w["seq"]
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    units = _units(workload, model)
    unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]
    root_bytes = params * 4 - sum(unit_bytes)
    largest = max(unit_bytes + [root_bytes])
    model = _wrap(impl, model, units, device)
    if workload == "mnist":
        optimizer: torch.optim.Optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return _Job(model, optimizer, batch, loss, items, params, largest)


def _wrap(impl: str, model: nn.Module, units: list[nn.Module], device: torch.device) -> nn.Module:
    if impl == "fullshard":
        chosen = {id(u) for u in units}
        return FSDP(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or id(module) in chosen)
    if impl in ("torch FSDP2", FULLY_SHARD):
        if impl == FULLY_SHARD:
            from fullshard.frontend.fully_shard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        for unit in units:
            fully_shard(unit)
        return fully_shard(model)  # type: ignore[return-value]
    if impl == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model  # FLOOR: no wrapper, no communication


def _step(job: _Job) -> None:
    job.optimizer.zero_grad()
    job.loss(job.model, job.batch).backward()
    job.optimizer.step()


def _bytes_sent(impl: str, param_bytes: int, world: int) -> int:
    """Bytes one rank sends per step, for the peers (fullshard's are counted by its collectives).

    DDP: a ring all-reduce of the gradients, 2 (N-1)/N x P. torch FSDP2 on gloo: all-gathers in
    forward and again in backward, (N-1)/N x P each, and its reduce-scatter, which torch runs on
    gloo as a full all-reduce, 2 (N-1)/N x P. No communication: 0.
    """
    f = (world - 1) / world
    return {"DDP": int(2 * f * param_bytes), "torch FSDP2": int(4 * f * param_bytes)}.get(impl, 0)


def compare_worker(workload: str, impl: str, steps: int, warmup: int) -> dict[str, Any] | None:
    """One rank, one implementation: build it from the seed, run ``warmup`` untimed and ``steps``
    timed steps; rank 0 returns the step times, the CPU seconds per step (user + system, all
    threads, mean over ranks), the peak RSS (or peak GPU memory) over ranks, the
    model-state bytes and the bytes sent per step.
    """
    device = launch.init_process_group()
    torch.set_num_threads(1)
    try:
        result = _compare_turn(workload, impl, steps, warmup, device)
        return result if collectives.group_rank(collectives.default_group()) == 0 else None
    finally:
        launch.destroy_process_group()  # the job is out of scope here: its groups end now


def _compare_turn(workload: str, impl: str, steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    from fullshard.engine.unit import GATHERED
    from fullshard.jobs.memory import model_state_bytes, peak_rss_bytes

    group = collectives.default_group()
    rank, world = collectives.group_rank(group), collectives.group_size(group)
    job = _build_job(workload, impl, device, rank)
    times, cpu = [], []
    for i in range(warmup + steps):
        if i == warmup:
            collectives.STATS.reset()
        collectives.barrier(group)
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        _step(job)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        spent = _cpu_seconds() - cpu_start
        collectives.all_reduce_max(elapsed, group)
        if i >= warmup:
            times.append(float(elapsed.item()))
            cpu.append(spent)
    collectives.STATS.bytes_sent.pop("all_reduce", None)  # the timing's own max-reduction
    sent = sum(collectives.STATS.bytes_sent.values()) // steps
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
        "gathered_bytes": GATHERED.peak_bytes if impl.startswith("fullshard") else _gathered_peak(impl, job, world),
        "items": job.items * world,
        "largest_unit_bytes": job.largest_unit_bytes,
        "world": world,
        "device": str(device),
        "bytes_sent": sent if impl.startswith("fullshard") else _bytes_sent(impl, job.params * 4, world),
    }
    return result


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads (gloo's included)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _gathered_peak(impl: str, job: _Job, world: int) -> int:
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
    for impl in (*IMPLEMENTATIONS, FLOOR):
        r = results[impl]
        state = r["model_state"]
        lines.append(
            f"| {impl} | {r['step_s']:.3f} ({ratio(impl, 'step_s')}) | {r['cpu_s']:.3f} | "
            f"{r['items_per_s']:,.0f} ({ratio(impl, 'items_per_s')}) | "
            f"{r['peak_rss'] / 2**20:,.0f} ({ratio(impl, 'peak_rss')}) | {state / 2**20:,.1f} "
            f"({ratio(impl, 'model_state')}) | "
            f"{r['gathered_bytes'] / 2**20:,.1f} | {r['bytes_sent'] / 2**20:,.1f} |"
        )
    return "\n".join(lines)


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


def machine_line(device: str) -> str:
    """Cores, memory, CPU (and GPU) model, torch version: where a table was measured."""
    import os
    import platform

    cpu, mem = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB, "
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if device.startswith("cuda") else ", no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {mem}torch {torch.__version__}{gpu}"


def write_chart(path: str, all_results: dict[str, dict[str, dict[str, Any]]]) -> None:
    """A PNG of step time and peak memory per implementation, one column per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("fullshard bench: --chart needs matplotlib: pip install 'fullshard[bench]'") from e
    names = (*IMPLEMENTATIONS, FLOOR)
    fig, axes = plt.subplots(2, len(all_results), figsize=(4.2 * len(all_results), 6.5), squeeze=False)
    for col, (workload, res) in enumerate(all_results.items()):
        for row, (key, label, scale) in enumerate(
            (("step_s", "step (s)", 1.0), ("peak_rss", "peak memory per rank (MiB)", 2**-20))
        ):
            ax = axes[row][col]
            ax.bar(
                range(len(names)),
                [res[n][key] * scale for n in names],
                color=["tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:gray"],
            )
            ax.set_xticks(range(len(names)), [n.replace(" ", "\n") for n in names], fontsize=8)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"{workload} ({res['fullshard']['params'] / 1e6:.1f}M params)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_markdown(path: str, section: str, begin: str = BEGIN_MARK, end: str = END_MARK) -> None:
    """Replace the generated section of ``path`` (between ``begin`` and ``end``), or append it."""
    import os

    text = open(path).read() if os.path.exists(path) else "# fullshard benchmarks\n"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip() + "\n\n" + block
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def run_compare(
    workloads: Sequence[str], steps: int, warmup: int, rounds: int, nproc: int
) -> tuple[str, dict[str, Any]]:
    """Run every workload; return the markdown section and the results per workload.

    Each turn (one implementation of one workload) runs in freshly started worker processes, so
    its peak RSS is its own and no allocator state carries over; ``rounds`` turns per
    implementation, the order reversed every other round, so drift in the machine's speed
    hits all of them alike.
    """
    impls = (*IMPLEMENTATIONS, FLOOR)
    all_results: dict[str, dict[str, Any]] = {}
    parts = []
    for workload in workloads:
        res: dict[str, dict[str, Any]] = {}
        for r in range(rounds):
            for impl in impls if r % 2 == 0 else impls[::-1]:
                turn = launch.launch(compare_worker, (workload, impl, steps, warmup), nproc, env=BENCH_ENV)[0]
                assert turn is not None
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fullshard bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu"]:
        from fullshard.jobs.bench import gpu

        return gpu.main(argv[1:])
    p = argparse.ArgumentParser(prog="fullshard bench", description=__doc__)
    p.add_argument("workload", choices=["prefetch", "optimizer", "compare", "gpu"])
    p.add_argument("--compare", default="compute", choices=sorted(COMPARE_WORKLOADS), help="compare: one workload")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted(COMPARE_WORKLOADS),
        help="compare: several workloads (overrides --compare)",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="compare: turns per implementation, the order reversed every other round"
    )
    p.add_argument("--write", metavar="MARKDOWN", help="compare: write the tables into this file's generated section")
    p.add_argument("--chart", metavar="PNG", help="compare: write a chart of step time and memory (needs matplotlib)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--numel", type=int, default=62_000_000, help="optimizer: elements per rank")
    args = p.parse_args(argv)
    if args.workload == "compare":
        workloads = args.workloads or [args.compare]
        section, all_results = run_compare(workloads, args.steps, args.warmup, args.rounds, args.nproc)
        command = "fullshard bench " + " ".join(argv)
        section = f"`{command}`\n\n{section}"
        print(section)
        if args.chart:
            write_chart(args.chart, all_results)
            section += f"\n![step time and peak memory per implementation]({args.chart})\n"
        if args.write:
            write_markdown(args.write, section)
        return 0
    if args.workload == "optimizer":
        torch.set_num_threads(1)
        opt_rows = optimizer_step_seconds(args.numel)
        print(
            f"CPU AdamW step over {args.numel / 1e6:.0f}M fp32 elements (one rank's shards), one thread, "
            f"torch {torch.__version__}"
        )
        print("| implementation | step (s) | vs for-loop |")
        print("|---|---|---|")
        for name, seconds in opt_rows:
            print(f"| {name} | {seconds:.3f} | {seconds / opt_rows[0][1]:.2f}x |")
        return 0
    rows = launch.launch(
        prefetch_worker, (args.d_model, args.layers, args.batch, args.steps), args.nproc, env=BENCH_ENV
    )[0]
    assert rows is not None
    base = rows[0][1]
    params = args.layers * (args.d_model**2 + args.d_model)
    print(
        f"prefetch benchmark: {args.layers} x Linear({args.d_model}, {args.d_model}) ({params / 1e6:.1f}M params), "
        f"batch {args.batch}, FULL_SHARD, {args.nproc} ranks, torch {torch.__version__}, median of {args.steps} steps"
    )
    print("| setting | step (s) | vs no prefetch |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.4f} | {seconds / base:.2f}x |")
    return 0
