"""``fullshard.memory_report``: where a wrapped model's memory is, per FSDP unit, on real tensors.

For each unit of a model wrapped by fullshard (the FSDP1 wrapper or ``fully_shard``): the full
parameter bytes one all-gather materializes (in the unit's compute dtype), this rank's shard
bytes (the storage, padding included), its sharded gradient bytes and the optimizer state of the
unit's parameters on this rank; the totals; and the reduction ratio against an unsharded replica
holding full parameters, full gradients and full optimizer state. Nothing is communicated: every
number is this rank's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fullshard.engine.hooks import fsdp_state
from fullshard.engine.module_wrapper import clean_name
from fullshard.plan.memory import _storage_bytes


@dataclasses.dataclass(frozen=True)
class UnitMemory:
    """One FSDP unit on this rank. Bytes are ints.

    Attributes:
        name: the unit's module name in the unwrapped model (``<root>`` for the root).
        numel: elements of the unit's full parameters (no padding).
        full_bytes: bytes of the full parameters while gathered, in the compute dtype (0 when
            the unit aliases its shards: one rank, same dtype, no offload).
        shard_bytes: bytes of this rank's parameter shards (their storage, padding included).
        grad_bytes: bytes of this rank's sharded gradients now (0 before backward or after
            ``zero_grad(set_to_none=True)``).
        optim_bytes: bytes of the optimizer state of the unit's parameters on this rank.
        full_state_bytes: parameters, gradients and optimizer state of an unsharded replica of
            the unit in the same dtypes (the optimizer's bytes per parameter element as measured).
    """

    name: str
    numel: int
    full_bytes: int
    shard_bytes: int
    grad_bytes: int
    optim_bytes: int
    full_state_bytes: int

    @property
    def sharded_state_bytes(self) -> int:
        return self.shard_bytes + self.grad_bytes + self.optim_bytes


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-unit rows and totals; ``str(report)`` is a markdown table."""

    units: list[UnitMemory]
    world_size: int

    def total(self, field: str) -> int:
        """The sum of ``field`` (a UnitMemory attribute) over the units."""
        return sum(getattr(u, field) for u in self.units)

    @property
    def reduction(self) -> float:
        """Unsharded model-state bytes over this rank's (parameters, gradients, optimizer)."""
        sharded = self.total("sharded_state_bytes")
        return self.total("full_state_bytes") / sharded if sharded else float("nan")

    def summary(self) -> str:
        """One line for a job's start-up banner: parameters full against this rank's shards,
        and the largest unit's gathered bytes."""
        full, shard = self.total("numel"), self.total("shard_bytes")
        largest = max(self.units, key=lambda u: u.full_bytes)
        return (
            f"memory: {len(self.units)} FSDP units, {full:,} parameters; this rank holds {_size(shard)} "
            f"of parameter shards ({self.world_size} ranks); the largest unit ({largest.name}) gathers "
            f"{_size(largest.full_bytes)}"
        )

    def __str__(self) -> str:
        mib = _size
        head = "| unit | parameters | full (gathered) | shard | grads | optimizer |"
        rows = [head, "|---|---|---|---|---|---|"]
        for u in self.units:
            cells = (u.full_bytes, u.shard_bytes, u.grad_bytes, u.optim_bytes)
            rows.append(f"| {u.name} | {u.numel:,} | " + " | ".join(mib(c) for c in cells) + " |")
        totals = [self.total(f) for f in ("full_bytes", "shard_bytes", "grad_bytes", "optim_bytes")]
        rows.append(f"| total | {self.total('numel'):,} | " + " | ".join(mib(c) for c in totals) + " |")
        rows.append(
            f"model state per rank {mib(self.total('sharded_state_bytes'))} against "
            f"{mib(self.total('full_state_bytes'))} unsharded: {self.reduction:.2f}x smaller "
            f"({self.world_size} ranks)"
        )
        return "\n".join(rows)


def _size(n: int) -> str:
    """Bytes for people: B, KiB, MiB or GiB with 3 significant digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Full against sharded bytes per FSDP unit of ``model`` on this rank (see module docstring).

    Args:
        model: a model wrapped by fullshard (``FullyShardedDataParallel`` or ``fully_shard``).
        optimizer: its optimizer, for the optimizer-state column (0 without it, or before its
            first step creates the state).

    Raises:
        ValueError: ``model`` holds no fullshard unit (not wrapped, or wrapped by torch).
    """
    rows, world = [], 1
    seen: set[int] = set()
    for name, module in model.named_modules():
        state = fsdp_state(module)
        if state is None or id(state.unit) in seen:
            continue
        seen.add(id(state.unit))
        world = max(world, state.unit.shard_size * state.unit.replicate_size)
        rows.append(_unit_row(clean_name(name) or "<root>", state.unit, optimizer))
    if not rows:
        raise ValueError(
            "memory_report: the model has no fullshard FSDP unit; wrap it with fullshard's "
            "FullyShardedDataParallel or fully_shard first"
        )
    return MemoryReport(rows, world)


def _unit_row(name: str, unit: Any, optimizer: torch.optim.Optimizer | None) -> UnitMemory:
    shards = [(sp, sp.shard) for sp in unit.params if sp.shard is not None]
    grads = [p.grad for _, p in shards if p.grad is not None]
    state: list[torch.Tensor] = []
    full_optim = 0  # an unsharded replica's: per-element state at the full size, scalars as they are
    for sp, p in shards:
        for v in (optimizer.state.get(p, {}) if optimizer is not None else {}).values():
            if isinstance(v, torch.Tensor):
                state.append(v)
                local = _local(v)
                per_element = local.numel() == _local(p).numel() and local.dim() > 0
                full_optim += (sp.spec.numel if per_element else local.numel()) * local.element_size()
    numel = sum(sp.spec.numel for sp in unit.params)
    trainable = sum(sp.spec.numel for sp in unit.params if sp.requires_grad)
    full_state = (numel + trainable) * unit.dtype.itemsize + full_optim
    return UnitMemory(
        name, numel, unit.full_nbytes, unit.sharded_nbytes, _storage_bytes(grads), _storage_bytes(state), full_state
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a fully_shard parameter is a DTensor
