"""``fullshard bench estimate --sweep N --seed S``: the estimator against measurement on drawn
configurations (:mod:`fullshard.jobs.planning.sweep`).

Each configuration is predicted with :func:`~fullshard.plan.peak.estimate_peak` (meta device,
gloo) and measured as ``fullshard bench estimate`` measures its own: ``world`` fresh processes
(:func:`~fullshard.jobs.launch.launch` with ``BENCH_ENV``) build the real model from seed 0
under :class:`~fullshard.plan.tracker.LiveTensorBytes`, apply activation checkpointing, wrap it
with the drawn front end, and train three steps of AdamW (fused) on random batches; the third
step's peak on rank 0 is the measurement, and its moment (the phase and the unit running, from
:class:`~fullshard.plan.running_unit.RunningUnit` on the plain model's names, BatchNorm units
included: :mod:`fullshard.jobs.planning.batch_norm`, or the optimizer step) is compared with
the predicted one. Estimates that rest on an assumption (``bound``: a mixture-of-experts
routing, traced so that their activations are an upper bound) are summarized apart from the
exact ones, with how many of them still fell below the measurement.

``--device cuda`` (and ``--device cpu``) runs the drawn configurations at world size 1 in this
process instead: :mod:`fullshard.jobs.planning.sweep_device`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from fullshard import compat
from fullshard.jobs import launch
from fullshard.jobs.planning import batch_norm, families
from fullshard.jobs.planning.families import DRAWN
from fullshard.jobs.planning.sweep import Config, draw, selective_context
from fullshard.plan.margin import MIB
from fullshard.plan.peak import PeakEstimate, estimate_peak
from fullshard.plan.running_unit import RunningUnit
from fullshard.plan.tracker import LiveTensorBytes


def _parts(c: Config) -> tuple[Any, Any, Any, Any]:
    return families.parts(c.family, c.shape, c.batch, c.seq)


def predict(c: Config, backend: str = "gloo", cpu_offload: bool = False) -> PeakEstimate:
    """The estimate of rank 0's peak for ``c`` on ``backend`` ("gloo" or "nccl"; ``cpu_offload``
    acts on nccl only).

    Raises:
        MetaValueRead: the model reads a tensor value the trace cannot give.
    """
    make, example, loss_fn, is_unit = _parts(c)
    return estimate_peak(
        make,
        example,
        loss_fn,
        is_unit,
        c.world,
        param_dtype=torch.bfloat16 if c.precision == "bf16" else None,
        checkpoint=is_unit if c.ac != "none" else None,
        checkpoint_context=selective_context if c.ac == "selective" else None,
        optimizer="adamw",
        sharding_strategy=c.strategy,
        backend=backend,
        cpu_offload=cpu_offload,
        front_end="wrapper" if c.api == "fsdp1" else "fully_shard",
        full_precision=(compat.BatchNormBase,) if c.precision == "bf16" else (),
    )


def wrap(
    c: Config,
    model: nn.Module,
    is_unit: Any,
    cpu_offload: bool = False,
    forward_prefetch: bool = False,
    backward_prefetch: str = "pre",
    mesh: Any = None,
) -> nn.Module:
    """``model`` with ``c``'s activation checkpointing on its units, then sharded by ``c``'s
    front end, one FSDP unit per ``is_unit`` module (as the training jobs shard), its shards
    in host memory with ``cpu_offload``, prefetching as the jobs' ``--forward-prefetch`` and
    ``--backward-prefetch`` (pre, post or none) say. ``mesh``: a 2-D (replicate, shard)
    DeviceMesh for hybrid sharding (the wrapper's FULL_SHARD becomes HYBRID_SHARD, its
    SHARD_GRAD_OP _HYBRID_SHARD_ZERO2), or None."""
    from fullshard.frontend.activation_checkpointing import apply_activation_checkpointing, checkpoint_wrapper
    from fullshard.frontend.wrap import lambda_auto_wrap_policy
    from fullshard.jobs.train import fsdp_options

    hybrid = {"full_shard": "hybrid_shard", "shard_grad_op": "_hybrid_shard_zero2"}
    opts = types.SimpleNamespace(
        sharding_strategy=hybrid[c.strategy] if mesh is not None and c.api == "fsdp1" else c.strategy,
        mixed_precision="bf16" if c.precision == "bf16" else "none",
        cpu_offload=cpu_offload,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        api=c.api,
    )
    fsdp_options.validate(opts)
    if c.ac != "none":
        kwargs: dict[str, Any] = {"context_fn": selective_context} if c.ac == "selective" else {}
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, **kwargs), check_fn=is_unit
        )
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit)
    if c.api == "fsdp2" and c.precision == "bf16":
        batch_norm.in_float32(model, cpu_offload, mesh, reshard=c.strategy == "full_shard")
    return fsdp_options.shard_model(model, opts, policy, mesh=mesh)


class Measured(NamedTuple):
    """One rank's third step: its peak live tensor bytes on the device, the moment of that peak
    (e.g. "backward of model.layers.1" or "optimizer step"), and on CUDA the caching
    allocator's peak in bytes above what was allocated before the model was built (0 on CPU)."""

    peak: int
    moment: str
    allocated: int = 0


def measure_rank(c: Config, device: torch.device, cpu_offload: bool = False) -> Measured:
    """On one rank of a started process group: ``c``'s third step measured (:class:`Measured`)."""
    make, example, loss_fn, is_unit = _parts(c)
    running: list[RunningUnit] = []
    stepping: list[bool] = []

    def moment() -> str:
        if stepping:
            return "optimizer step"
        return running[0].moment if running else "building"

    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    with LiveTensorBytes(device_type=device.type, label=moment) as live:
        torch.manual_seed(0)
        model = make().to(device)
        running.append(RunningUnit(model, batch_norm.engine_units(c, is_unit)))
        model = wrap(c, model, is_unit, cpu_offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for _ in range(3):
            drawn = families.random_batch(c.family, example, c.shape.vocab, c.shape.classes)
            batch = tuple(t.to(device) for t in drawn)
            live.reset_peak()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            loss_fn(model, batch).backward()
            stepping.append(True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            stepping.clear()
        allocated = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    return Measured(live.peak, str(live.peak_label), allocated)


def _worker(c: Config) -> Measured:
    device = launch.init_process_group()
    try:
        return measure_rank(c, device)
    finally:
        launch.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration's outcome: the estimate (None when the trace failed), the measured
    peak (bytes) and moment, the failure message if any, and the seconds the real run took."""

    config: Config
    estimate: PeakEstimate | None
    measured: int
    moment: str
    failure: str = ""
    seconds: float = 0.0

    @property
    def error(self) -> float:
        """(predicted - measured) / measured; NaN without both."""
        if self.estimate is None or not self.measured:
            return math.nan
        return (self.estimate.total - self.measured) / self.measured


def predicted(c: Config, backend: str = "gloo", cpu_offload: bool = False) -> tuple[PeakEstimate | None, str]:
    """(:func:`predict`'s estimate, "") or, when the trace fails, (None, the failure as a table
    note): a trace failure is a result of the sweep, reported as such."""
    try:
        return predict(c, backend, cpu_offload), ""
    except Exception as err:
        return None, f"trace: {type(err).__name__}: {str(err)[:200]}"


def run_one(c: Config) -> Row:
    """Predict and measure ``c``; a trace or run failure becomes the row's ``failure``."""
    estimate, failure = predicted(c)
    start = time.perf_counter()
    try:
        peak, moment, _ = launch.launch(_worker, (c,), c.world, env=launch.BENCH_ENV)[0]
    except launch.WorkerFailed as err:
        peak, moment = 0, ""
        failure = (failure + "; " if failure else "") + f"run: {str(err)[:200]}"
    return Row(c, estimate, peak, moment, failure, time.perf_counter() - start)


def cell(c: Config) -> str:
    """``c.describe()`` as one markdown table cell (its ``|`` escaped)."""
    return c.describe().replace("|", "\\|")


def format_row(r: Row) -> str:
    """The row as a markdown table line (MiB, error in %)."""
    e = r.estimate
    predicted = f"{e.total / MIB:.2f}" if e is not None else "-"
    measured = f"{r.measured / MIB:.2f}" if r.measured else "-"
    err = f"{100 * r.error:+.1f}%" if not math.isnan(r.error) else "-"
    moment = f"{e.moment} / {r.moment}" if e is not None else f"- / {r.moment}"
    same = "yes" if e is not None and e.moment == r.moment else "no"
    note = r.failure or (e.bound if e is not None else "")
    return f"| {cell(r.config)} | {predicted} | {measured} | {err} | {moment} | {same} | {note} |"


HEADER = [
    "| configuration | predicted (MiB) | measured (MiB) | error | moment predicted / measured | same | note |",
    "|---|---|---|---|---|---|---|",
]


def families_option(families: tuple[str, ...]) -> str:
    """The ``--families`` option that draws ``families`` again ("" for the default)."""
    return "" if tuple(families) == DRAWN else f" --families {','.join(families)}"


def report(seed: int, n: int, families: tuple[str, ...] = DRAWN) -> Iterator[str]:
    """Draw ``n`` configurations from ``seed`` among ``families``, predict and measure each;
    yields the markdown lines as they come (the table, then :func:`summary`)."""
    command = f"fullshard bench estimate --sweep {n} --seed {seed}{families_option(families)}"
    yield f"Seed {seed}, {n} configurations (`{command}` draws them again).\n"
    yield from HEADER
    rows = []
    for c in draw(seed, n, families):
        rows.append(run_one(c))
        yield format_row(rows[-1])
    yield ""
    yield from summary(rows)


def distribution(errors: list[float]) -> str:
    """max, p95 (nearest rank), median |error| and the signed mean, in %, of ``errors``
    (fractions; NaNs left out)."""
    signed = [e for e in errors if not math.isnan(e)]
    if not signed:
        return "no measured configuration"
    size = sorted(abs(e) for e in signed)
    p95 = size[max(0, math.ceil(0.95 * len(size)) - 1)]
    mid = len(size) // 2
    median = size[mid] if len(size) % 2 else (size[mid - 1] + size[mid]) / 2
    return (
        f"max |error| {100 * size[-1]:.1f}%, p95 {100 * p95:.1f}%, median {100 * median:.1f}%, "
        f"signed mean {100 * sum(signed) / len(signed):+.1f}% over {len(signed)}"
    )


def summary(rows: list[Row]) -> Iterator[str]:
    """The sweep's distribution (exact and bounded estimates apart), the moments matched, the
    failures, and each family's worst error, as markdown lines."""
    exact = [r for r in rows if r.estimate is not None and not r.estimate.bound]
    bounded = [r for r in rows if r.estimate is not None and r.estimate.bound]
    yield f"Exact estimates: {distribution([r.error for r in exact])}."
    if bounded:
        under = [r for r in bounded if r.measured and r.estimate is not None and r.estimate.total < r.measured]
        yield (
            f"Routing assumed (eager MoE, activations bounded): {distribution([r.error for r in bounded])}; "
            f"{len(under)} below the measured peak."
        )
    timed = [r for r in rows if r.estimate is not None and r.measured]
    same = sum(r.estimate is not None and r.estimate.moment == r.moment for r in timed)
    yield f"Moment of the peak matched in {same} of {len(timed)} configurations."
    failed = [r for r in rows if r.failure]
    yield f"Failures: {len(failed)}" + (
        ": " + "; ".join(f"{r.config.describe()}: {r.failure}" for r in failed) if failed else "."
    )
    yield "\n| family | configurations | worst error | mean error |\n|---|---|---|---|"
    for family in families.FAMILIES:
        errs = [r.error for r in rows if r.config.family == family and not math.isnan(r.error)]
        if errs:
            worst = max(errs, key=abs)
            yield f"| {family} | {len(errs)} | {100 * worst:+.1f}% | {100 * sum(errs) / len(errs):+.1f}% |"
    yield f"\nReal runs took {sum(r.seconds for r in rows):.0f} s in all."
