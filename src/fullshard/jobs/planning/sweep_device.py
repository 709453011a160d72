"""``fullshard bench estimate --sweep N --seed S --device cuda``: the estimator checked where the
multi-process sweep of :mod:`fullshard.jobs.planning.sweep_bench` cannot, on one CUDA device
(:func:`device_report`). Each drawn configuration is run at world size 1 in this process (one
NCCL rank; one GPU allows no more), once as drawn and once with CPU offload, and predicted for
NCCL (``backend="nccl"``, whose estimates are meant as an upper bound,
:data:`~fullshard.plan.peak.NOT_REPLAYED`). Besides the live tensor bytes on the device it
reports the CUDA caching allocator's peak (``torch.cuda.max_memory_allocated`` above what was
allocated before the model was built), which is what a GPU budget must hold. ``--device cpu``
runs the same way on gloo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable, Iterator

import torch

from fullshard.jobs import launch
from fullshard.jobs.planning.families import DRAWN
from fullshard.jobs.planning.sweep import Config, draw
from fullshard.jobs.planning.sweep_bench import (
    Measured,
    Row,
    cell,
    distribution,
    families_option,
    measure_rank,
    predicted,
)
from fullshard.plan.margin import MIB


@dataclasses.dataclass(frozen=True)
class DeviceRow:
    """One configuration measured at world size 1 in this process (:func:`device_report`):
    ``row`` holds its estimate for the device's backend and the live tensor bytes measured,
    ``offload`` whether its shards were in host memory, ``allocated`` the caching allocator's
    peak in bytes (0 on CPU)."""

    row: Row
    offload: bool
    allocated: int

    @property
    def allocator_error(self) -> float:
        """(predicted - allocator peak) / allocator peak; NaN without both."""
        e = self.row.estimate
        if e is None or not self.allocated:
            return math.nan
        return (e.total - self.allocated) / self.allocated


def _fresh(device: torch.device) -> None:
    """Drop what the last configuration left: the engine's pooled buffers, garbage, CUDA's cache."""
    import gc

    from fullshard.comm import buffers

    buffers.POOL.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_on_device(c: Config, device: torch.device, cpu_offload: bool = False) -> DeviceRow:
    """Predict ``c`` for ``device``'s backend (nccl on CUDA, else gloo) and measure it on rank 0
    of the started process group, in this process; failures become the row's note."""
    estimate, failure = predicted(c, "nccl" if device.type == "cuda" else "gloo", cpu_offload)
    _fresh(device)
    start = time.perf_counter()
    try:
        m = measure_rank(c, device, cpu_offload)
    except Exception as err:  # so is a run failure (an out-of-memory one included)
        m = Measured(0, "")
        failure = (failure + "; " if failure else "") + f"run: {type(err).__name__}: {str(err)[:200]}"
    finally:
        _fresh(device)
    return DeviceRow(Row(c, estimate, m.peak, m.moment, failure, time.perf_counter() - start), cpu_offload, m.allocated)


# The MNIST configuration :func:`warm_up` runs (its shape fields are unused by the family).
_WARM_UP_CONFIG = Config(0, 0, "mnist", draw(0, 1)[0].shape, 2, 32, "full_shard", "none", "fp32", 1, "fsdp1")


def warm_up(device: torch.device) -> int:
    """Run a matrix product forward and backward in float32 and bfloat16, then three unmeasured
    steps of the MNIST family's model (convolutions, pooling, dropout) in each precision, so that
    what cuBLAS and cuDNN keep for the process's life (cuBLAS's workspaces, one per thread and
    stream, and what cuDNN takes on its first convolutions, taken from the caching allocator)
    exists before any measurement; returns the bytes then allocated (0 on CPU). Needs a started
    one-rank process group whose device is ``device`` (:func:`one_rank_group`).

    A lone 2-D convolution did not do it: on an H100 the first MNIST configuration of a sweep
    still peaked 1 MiB higher at the allocator than the same configuration run later."""
    if device.type != "cuda":
        return 0
    precisions = ("fp32", "bf16") if torch.cuda.is_bf16_supported() else ("fp32",)
    for precision in precisions:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        (x @ x).sum().backward()
        vision = dataclasses.replace(_WARM_UP_CONFIG, precision=precision)
        measure_rank(vision, device)
        _fresh(device)
    torch.cuda.synchronize(device)
    _fresh(device)
    return torch.cuda.memory_allocated(device)


DEVICE_HEADER = [
    "| configuration | offload | predicted (MiB) | live peak (MiB) | error | allocator peak (MiB) | error vs allocator "
    "| moment predicted / measured | same | note |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def format_device_row(d: DeviceRow) -> str:
    """The row as a markdown table line (MiB, errors in %); the note names a failure, or an
    estimate that assumed a routing (the NCCL bound every row carries is left out)."""
    r, e = d.row, d.row.estimate
    pct = lambda x: f"{100 * x:+.1f}%" if not math.isnan(x) else "-"  # noqa: E731
    mib = lambda b: f"{b / MIB:.2f}" if b else "-"  # noqa: E731
    moment = f"{e.moment if e is not None else '-'} / {r.moment}"
    same = "yes" if e is not None and e.moment == r.moment else "no"
    note = r.failure or ("routing assumed" if e is not None and "routing" in e.bound else "")
    return (
        f"| {cell(r.config)} | {'yes' if d.offload else 'no'} | {mib(e.total if e is not None else 0)} | "
        f"{mib(r.measured)} | {pct(r.error)} | {mib(d.allocated)} | {pct(d.allocator_error)} | {moment} | {same} | "
        f"{note} |"
    )


def device_summary(rows: list[DeviceRow], tolerance: int = 16) -> Iterator[str]:
    """Per offload setting: the error distributions against the live bytes and the allocator's
    peak, and how many estimates fell more than ``tolerance`` bytes below each (a broken upper
    bound; the default, 16, is the few 0-dim scalars the trace does not see); then the moments
    matched and the failures."""

    def under(predicted: int, measured: int) -> bool:
        return predicted < measured - tolerance

    for offload in sorted({d.offload for d in rows}):
        some = [d for d in rows if d.offload == offload and d.row.estimate is not None and d.row.measured]
        below = sum(under(d.row.estimate.total, d.row.measured) for d in some if d.row.estimate is not None)
        head = "With CPU offload" if offload else "Without offload"
        errors = distribution([d.row.error for d in some])
        yield f"{head}, live tensor bytes: {errors}; {below} below the measured peak by more than {tolerance} bytes."
        timed = [d for d in some if d.allocated]
        if timed:
            short = sum(under(d.row.estimate.total, d.allocated) for d in timed if d.row.estimate is not None)
            yield (
                f"{head}, allocator peak: {distribution([d.allocator_error for d in timed])}; "
                f"{short} below the allocator's peak."
            )
    measured = [d.row for d in rows if d.row.estimate is not None and d.row.measured]
    same = sum(r.estimate is not None and r.estimate.moment == r.moment for r in measured)
    yield f"Moment of the peak matched in {same} of {len(measured)} runs."
    failed = [d for d in rows if d.row.failure]
    yield f"Failures: {len(failed)}" + (
        ": " + "; ".join(f"{d.row.config.describe()} offload={d.offload}: {d.row.failure}" for d in failed)
        if failed
        else "."
    )


def device_rows(configs: Iterable[Config], device: torch.device) -> Iterator[DeviceRow]:
    """Each of ``configs`` at world size 1, predicted and measured in this process on
    ``device`` (:func:`run_on_device`): on CUDA with and without CPU offload, NO_SHARD without
    only (the estimator does not model NO_SHARD under offload on CUDA). Needs a started one-rank process
    group whose device is ``device`` (:func:`one_rank_group`), and :func:`warm_up` first."""
    offloads = (False, True) if device.type == "cuda" else (False,)
    for c in configs:
        for offload in offloads if c.strategy != "no_shard" else (False,):
            yield run_on_device(dataclasses.replace(c, world=1), device, offload)


def device_report(seed: int, n: int, device: torch.device, families: tuple[str, ...] = DRAWN) -> Iterator[str]:
    """Draw ``n`` configurations from ``seed`` among ``families``, each at world size 1, and predict and measure
    each in this process on ``device`` (on CUDA with and without CPU offload, NO_SHARD without:
    the estimator does not model NO_SHARD under offload on CUDA); yields the
    markdown lines as they come. Needs a started one-rank process group whose device is
    ``device`` (:func:`one_rank_group`)."""
    workspace = warm_up(device)
    held = f"; cuBLAS's workspaces, allocated before and left out of the allocator's peaks: {workspace} bytes"
    yield (
        f"Seed {seed}, {n} configurations at world size 1 on {device.type} "
        f"(`fullshard bench estimate --sweep {n} --seed {seed}{families_option(families)} --device {device.type}` "
        "draws them again)" + (held if workspace else "") + ".\n"
    )
    yield from DEVICE_HEADER
    rows = []
    for row in device_rows(draw(seed, n, families), device):
        rows.append(row)
        yield format_device_row(row)
    yield ""
    yield from device_summary(rows)
    yield f"\nReal runs took {sum(d.row.seconds for d in rows):.0f} s in all."


@contextlib.contextmanager
def one_rank_group(device_type: str) -> Iterator[torch.device]:
    """A one-rank default process group in this process (NCCL on CUDA, gloo on CPU), destroyed
    on exit; yields its device. The environment variables it sets (the launcher's, gloo's
    interface) are restored after; the current CUDA device stays device 0.

    Raises:
        SystemExit: ``device_type`` is "cuda" and no CUDA device is visible, or not "cpu"/"cuda";
            or a default process group exists already (this one would not be a one-rank group
            of its own: destroy that one first).
    """
    if device_type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {device_type!r}: choose cpu or cuda")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here; run on a GPU machine or use --device cpu")
    from fullshard.comm import collectives

    if collectives.is_initialized():
        raise SystemExit(
            "one_rank_group: a default process group exists already; the device sweep needs its own one-rank "
            "group: run it in a fresh process, or call torch.distributed.destroy_process_group() first"
        )
    import os

    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(launch.free_port()),
    }
    if device_type == "cpu":
        env["LOCAL_RANK"] = str(torch.cuda.device_count())  # no device under that rank: gloo on CPU
    saved = {k: os.environ.get(k) for k in (*env, "GLOO_SOCKET_IFNAME")}
    os.environ.update(env)
    try:
        yield launch.init_process_group()
    finally:
        launch.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
