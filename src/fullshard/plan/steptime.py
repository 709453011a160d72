"""Step-time prediction: calibrate once on this machine, then predict any configuration.

:func:`calibrate` (collective, a few seconds) measures the collectives of this backend and
world size, each distinct block's forward and backward at the real batch shape, plain and as
activation checkpointing runs it (the recomputation and the checkpointing's own work in its
backward), the optimizer's seconds per parameter, and the engine's own time per unit of each
kind (:mod:`fullshard.plan.overhead`); :func:`predict_step` turns a configuration (per-unit
resharding, activation checkpointing, mixed precision, NO_SHARD, units of several blocks) into
unit costs and replays fullshard's schedule (:func:`~fullshard.plan.simulate.simulate_step`).
Every rank calibrates at once; each time is the slowest rank's, as a step waits for the slowest
rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from fullshard.comm import buffers, collectives
from fullshard.plan.calibrate import (
    BlockTime,
    CommModel,
    calibrate_comm,
    calibrate_copies,
    time_optimizer,
    time_units,
)
from fullshard.plan.estimate import UnitEstimate, estimate_model_state, owned_params
from fullshard.plan.overhead import NONE, Overhead, calibrate_overhead
from fullshard.plan.peak import offloads
from fullshard.plan.simulate import StepTime, UnitCost, merge_costs, simulate_step

OPTIMIZER_TIMING_NUMEL = 1 << 24  # the most parameters an optimizer step is timed over (64 MiB in float32)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`predict_step` needs from the machine: collective costs (``comm``), block
    times by unit name (``blocks``, ``"<root>"`` included) and optimizer seconds per parameter."""

    comm: CommModel
    blocks: dict[str, BlockTime]
    optimizer_seconds_per_param: float
    optimizer: str
    checkpointed: dict[str, BlockTime] = dataclasses.field(default_factory=dict)
    """Each unit's times as activation checkpointing runs it, its backward including the
    recomputed forward; where absent, ``blocks``' with one more forward in the backward."""
    host_optimizer_seconds_per_param: float = 0.0
    """The optimizer step on the CPU (CPU offload), measured on CUDA; 0 where not (a CPU device)."""
    overhead: Overhead = NONE
    """The engine's own seconds per unit and step beyond compute and collectives, by kind of unit
    (:func:`~fullshard.plan.overhead.calibrate_overhead`); none where not measured."""
    leftover_bytes: int = 0
    """Bytes the planner counts on top of every prediction: on CPU, those calibration left in
    the buffer pool (0 when it released everything, as :func:`calibrate` does); on CUDA, all
    the caching allocator hands the process after calibration (``torch.cuda.memory_allocated``:
    cuBLAS's workspaces, which calibration's matrix products create and the process keeps, and
    whatever else is on the device)."""


def calibrate(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    device: torch.device,
    *,
    compute_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    group: Any = None,
) -> Calibration:
    """Measure this machine for the model (collective: every rank of ``group`` calls it): the
    collectives, the blocks (plain and checkpointed), the optimizer, the engine's own time per
    unit (on a stand-in model of as many units). On CUDA it also measures what CPU offload
    costs: pinned copies each way and the optimizer step on the CPU.

    It leaves nothing behind for training to carry: the collectives' scratch buffers it gives
    to :data:`~fullshard.comm.buffers.POOL` are dropped (sizes of its own that training need
    not ask for again), and the blocks, stand-ins, tensors and optimizers it times are freed on
    return (``fully_shard``'s default device mesh, made once per process, stays). On CUDA what
    the process keeps on the device regardless (cuBLAS's workspaces) is
    :attr:`Calibration.leftover_bytes`.

    Args:
        make_model: builds a fresh, unsharded model on ``device``.
        example: returns one micro-batch (what ``loss_fn`` takes).
        loss_fn: ``loss_fn(model, batch)`` -> a scalar loss tensor.
        is_unit: which modules the wrapping may make units (``fullshard.wrap.is_unit`` or a policy's test).
        device: where the model trains.
        compute_dtype: the mixed-precision parameter dtype, or None for the model's own.
        optimizer: "adamw" (or "adam"), "adadelta", else SGD: the step whose time is measured.
        group: the process group (default: the world).

    Returns:
        a :class:`Calibration`: collective costs, block times (seconds) by unit, plain and
        checkpointed, optimizer seconds per parameter, the engine's seconds per unit.
    """
    held = buffers.POOL.nbytes
    with buffers.POOL.transient():
        cal = _calibrate(make_model, example, loss_fn, is_unit, device, compute_dtype, optimizer, group)
    if device.type == "cuda":
        # Everything the caching allocator hands this process now stays out of the budget:
        # cuBLAS's workspaces (one per thread and stream, kept for the process's life: 64 MiB
        # on an H100), tensors made before planning, pooled buffers.
        return dataclasses.replace(cal, leftover_bytes=torch.cuda.memory_allocated(device))
    return dataclasses.replace(cal, leftover_bytes=max(0, buffers.POOL.nbytes - held))


def _calibrate(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    device: torch.device,
    compute_dtype: torch.dtype | None,
    optimizer: str,
    group: Any,
) -> Calibration:
    group = group if group is not None else collectives.default_group()
    comm = calibrate_comm(group)
    h2d, d2h = calibrate_copies(device)
    comm = dataclasses.replace(comm, h2d=h2d, d2h=d2h)
    timed = time_units(make_model, example, loss_fn, is_unit, device, compute_dtype)
    blocks, alone = timed.blocks, timed.checkpointed
    with torch.device("meta"):
        meta = make_model()
    numel = sum(p.numel() for p in meta.parameters())
    # an optimizer step's time is linear in its elements: time at most 2**24 (a whole shard of a
    # large model would take its parameters, gradients and state once more, on each rank at once)
    shard = max(1, min(numel // collectives.group_size(group), OPTIMIZER_TIMING_NUMEL))
    per_param = time_optimizer(shard, device, optimizer) / shard
    cpu = torch.device("cpu")
    host_per_param = time_optimizer(shard, cpu, optimizer) / shard if device.type == "cuda" else 0.0
    # A step runs at the pace of the slowest rank (every collective waits for it): keep each
    # time's maximum over the ranks, which time the same blocks at the same moment.
    names, checkpointed = list(blocks), list(alone)
    times = [t for d, ns in ((blocks, names), (alone, checkpointed)) for n in ns for t in (d[n].forward, d[n].backward)]
    times += [per_param, host_per_param]
    slowest = torch.tensor(times, dtype=torch.float64, device=collectives.reduction_device(group))
    collectives.all_reduce_max(slowest, group)
    values = slowest.tolist()
    pairs = [BlockTime(values[2 * i], values[2 * i + 1]) for i in range(len(names) + len(checkpointed))]
    blocks = dict(zip(names, pairs))
    alone = dict(zip(checkpointed, pairs[len(names) :]))
    overhead = _overhead(
        comm, meta, is_unit, [n for n in names if n != "<root>"], device, compute_dtype, optimizer, group
    )
    return Calibration(comm, blocks, values[-2], optimizer, alone, values[-1], overhead)


def _overhead(
    comm: CommModel,
    meta: nn.Module,
    is_unit: Callable[[nn.Module], bool],
    units: list[str],
    device: torch.device,
    compute_dtype: torch.dtype | None,
    optimizer: str,
    group: Any,
) -> Overhead:
    """:func:`~fullshard.plan.overhead.calibrate_overhead` on a stand-in shaped as ``meta``: its
    timed units' count, their median parameter count, the root's."""
    owned = owned_params(meta, is_unit)
    counts = sorted(len(owned.get(n, [])) for n in units)
    per_unit = counts[len(counts) // 2] if counts else 0
    return calibrate_overhead(
        comm,
        len(units),
        per_unit,
        len(owned[""]),
        device,
        compute_dtype=compute_dtype,
        optimizer=optimizer,
        group=group,
    )


def predict_step(
    cal: Calibration,
    make_model: Callable[[], nn.Module],
    is_unit: Callable[[nn.Module], bool],
    *,
    no_shard: bool = False,
    keep_gathered: Collection[str] = (),
    checkpoint: Collection[str] = (),
    param_dtype: torch.dtype | None = None,
    forward_prefetch: bool = False,
    backward_prefetch: str | None = "pre",
    group: int = 1,
    state: list[UnitEstimate] | None = None,
    offload: bool = False,
) -> StepTime:
    """Predicted step time of one configuration on the calibrated machine.

    Args:
        keep_gathered: units that do not reshard after forward (SHARD_GRAD_OP for them).
        checkpoint: units whose activations are recomputed in backward.
        param_dtype: the mixed-precision dtype (gathers and reductions in it), if any.
        group: consecutive units sharded together as one (``fully_shard`` of a list).
        state: :func:`~fullshard.plan.estimate.estimate_model_state` of the model at these
            settings, when the caller has it (saves building the model on the meta device).
        offload: CPU offload of shards, gradients and the optimizer step (uploads before each
            gather, downloads after each reduce-scatter, the step at the CPU's calibrated rate);
            on gloo it changes nothing, as the engine ignores it on a CPU.

    Raises:
        KeyError: a unit has no calibrated block time (calibrated on another model).
        ValueError: ``group`` is below 1.
    """
    world = cal.comm.world_size
    offload = offloads(offload, cal.comm.backend)  # on a CPU device offload moves nothing
    units = state
    if units is None:
        with torch.device("meta"):
            model = make_model()
        strategy = "no_shard" if no_shard else "full_shard"
        units = estimate_model_state(
            model, is_unit, world, sharding_strategy=strategy, param_dtype=param_dtype, offload=offload
        )
    costs = _unit_costs(cal, units, world, keep_gathered, checkpoint, param_dtype, offload)
    root, rest = costs[0], merge_costs(costs[1:], group)
    root, *rest = (  # the engine's own work, per unit (a group of blocks is one unit)
        dataclasses.replace(u, overhead=cal.overhead.per_unit(no_shard, u.reshard_after_forward)) for u in [root, *rest]
    )
    local = sum(u.numel for u in units) if no_shard else sum(u.numel for u in units) // world
    per_param = cal.host_optimizer_seconds_per_param if offload else cal.optimizer_seconds_per_param
    return simulate_step(
        root,
        rest,
        cal.comm,
        no_shard=no_shard,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        optimizer_seconds=local * per_param,
    )


def _unit_costs(
    cal: Calibration,
    units: list[UnitEstimate],
    world: int,
    keep_gathered: Collection[str],
    checkpoint: Collection[str],
    param_dtype: torch.dtype | None,
    offload: bool,
) -> list[UnitCost]:
    """Each timed unit's compute, bytes moved and settings (forward order, the root first)."""
    reduce_size = param_dtype.itemsize if param_dtype is not None else 4
    return [
        UnitCost(
            u.name,
            _checkpointed(cal, u.name) if u.name in checkpoint else cal.blocks[u.name],
            gather_bytes=u.full_bytes if world > 1 else 0,
            reduce_bytes=u.numel * reduce_size if world > 1 else 0,
            reshard_after_forward=u.name not in keep_gathered,
            checkpoint=u.name in checkpoint,
            h2d_bytes=u.shard_bytes if offload else 0,
            d2h_bytes=u.grad_bytes if offload else 0,
        )
        for u in units
        if u.name in cal.blocks  # else a unit nested in another: timed with its parent
    ]


def _checkpointed(cal: Calibration, name: str) -> BlockTime:
    """Unit ``name``'s times under activation checkpointing: calibrated, else its plain forward
    once more in the backward (the recomputation alone, no checkpointing overhead)."""
    if name in cal.checkpointed:
        return cal.checkpointed[name]
    plain = cal.blocks[name]
    return BlockTime(plain.forward, plain.backward + plain.forward)
