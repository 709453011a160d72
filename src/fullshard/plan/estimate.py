"""Predicted model-state bytes per rank of an FSDP configuration, without allocating the model.

The model is built on the meta device; the auto-wrap policy decides the units as the wrapper
would (a module the policy accepts becomes a unit owning the parameters below it that no
nested unit owns; the root owns the rest), and fullshard's own shard geometry
(:class:`fullshard.engine.sharded_param.ShardSpec`: rows split in equal padded chunks) gives
each rank's bytes:

- parameter shards: the unit's padded flat shard, ``sum(ceil(rows / N) x row elements)`` in the
  parameter dtype;
- sharded gradients: the same for the trainable parameters;
- optimizer state of this rank's (unpadded) rows: AdamW and Adadelta two per-element buffers
  and a 0-dim float32 step per parameter, SGD with momentum one buffer, plain SGD none;
- the full parameters one all-gather materializes: ``N x shard`` in the compute dtype (the
  mixed-precision ``param_dtype`` when given), none when one rank holds a unit in its own dtype.

Activations, temporaries and the schedule's peak are not predicted here yet (issue 17).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from fullshard.engine.sharded_param import ShardSpec, one_rank_align

OPTIMIZER_BUFFERS = {"adamw": (2, True), "adam": (2, True), "adadelta": (2, True), "sgd": (0, False)}


@dataclasses.dataclass(frozen=True)
class UnitEstimate:
    """One unit's predicted bytes on one rank (ints); names as in :class:`~fullshard.plan.memory_report.UnitMemory`."""

    name: str
    numel: int
    shard_bytes: int
    grad_bytes: int
    optim_bytes: int
    full_bytes: int


def owned_params(model: nn.Module, is_unit: Callable[[nn.Module], bool]) -> dict[str, list[nn.Parameter]]:
    """Unit name ("" for the root) -> the parameters it owns, in the model's order (nested
    units first claim theirs, as the wrapper does)."""
    heads = {"": model} | {n: m for n, m in model.named_modules() if n and is_unit(m)}
    owner: dict[int, str] = {}
    for name in sorted(heads, key=lambda n: -len(n.split(".")) if n else 0):  # deepest first, the root last
        for p in heads[name].parameters():
            owner.setdefault(id(p), name)
    out: dict[str, list[nn.Parameter]] = {name: [] for name in heads}
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[owner[id(p)]].append(p)
    return out


def estimate_model_state(
    model: nn.Module,
    is_unit: Callable[[nn.Module], bool],
    world_size: int,
    *,
    rank: int = 0,
    sharding_strategy: str = "full_shard",
    param_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    offload: bool = False,
    full_precision: Collection[str] = (),
) -> list[UnitEstimate]:
    """Predict each unit's parameter-shard, gradient, optimizer and gathered bytes on ``rank``.

    Args:
        model: the unwrapped model, best built on the meta device (only shapes, dtypes and
            ``requires_grad`` are read).
        is_unit: which modules the auto-wrap policy makes units (the root always is one).
        world_size: ranks the parameters are sharded over (``no_shard``: kept whole).
        sharding_strategy: ``full_shard``, ``shard_grad_op`` or ``no_shard``.
        param_dtype: the mixed-precision compute dtype, if any.
        optimizer: ``adamw``, ``adam``, ``adadelta`` or ``sgd`` (with ``momentum``).
        offload: CPU offload (on CUDA): shards on the host, so even one rank gathers a full copy.
        full_precision: names of units that gather and compute in their parameters' own dtype
            whatever ``param_dtype`` says (the FSDP1 wrapper's BatchNorm units under mixed
            precision, ``MixedPrecision._module_classes_to_ignore``).

    Raises:
        ValueError: an unknown ``sharding_strategy`` or ``optimizer``, or ``rank`` outside
            ``[0, world_size)``.
    """
    if sharding_strategy not in ("full_shard", "shard_grad_op", "no_shard"):
        raise ValueError(f"sharding_strategy={sharding_strategy!r}: use full_shard, shard_grad_op or no_shard")
    if optimizer not in OPTIMIZER_BUFFERS:
        raise ValueError(f"optimizer={optimizer!r}: use one of {', '.join(OPTIMIZER_BUFFERS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    world = 1 if sharding_strategy == "no_shard" else world_size
    me = 0 if sharding_strategy == "no_shard" else rank
    buffers, step = OPTIMIZER_BUFFERS[optimizer]
    if optimizer == "sgd" and momentum:
        buffers = 1
    out = []
    for name, params in owned_params(model, is_unit).items():
        own = name in full_precision
        cast = param_dtype if param_dtype is not None and not own else None
        # One rank: each padded shard rounded up to 64 bytes, as the layout does (ShardSpec.align).
        specs = [(ShardSpec(p.shape, world, me, 0, one_rank_align(world, p.dtype, cast or p.dtype)), p) for p in params]
        shard = sum(s.padded_shard_numel * p.element_size() for s, p in specs)
        grads = sum(s.padded_shard_numel * p.element_size() for s, p in specs if p.requires_grad)
        optim = sum(
            buffers * s.local_numel * p.element_size() + (4 if step else 0) for s, p in specs if p.requires_grad
        )
        compute = cast.itemsize if cast is not None else None
        same = compute is None or all(p.element_size() == compute for p in params)
        full = (
            0
            if world == 1 and same and not offload  # one rank computes on its shard, unless it is on the host
            else sum(world * s.padded_shard_numel * (compute or p.element_size()) for s, p in specs)
        )
        out.append(UnitEstimate(name or "<root>", sum(p.numel() for p in params), shard, grads, optim, full))
    return out


def group_units(units: list[UnitEstimate], groups: Sequence[Sequence[str]]) -> list[UnitEstimate]:
    """``units`` with each group of unit names (``fully_shard`` of a list of modules: one unit)
    merged into one, named after its first member, bytes and element counts summed; units in no
    group are kept as they are, in their order.

    Raises:
        KeyError: a name in ``groups`` is not one of ``units``.
    """
    by_name = {u.name: u for u in units}
    missing = [n for g in groups for n in g if n not in by_name]
    if missing:
        raise KeyError(f"groups name {missing} that are not units ({', '.join(by_name)})")
    first = {g[0]: g for g in groups if len(g) > 1}
    merged = {n for g in first.values() for n in g[1:]}
    out = []
    for u in units:
        if u.name in merged:
            continue
        members = [by_name[n] for n in first.get(u.name, (u.name,))]
        out.append(
            UnitEstimate(
                u.name,
                sum(m.numel for m in members),
                sum(m.shard_bytes for m in members),
                sum(m.grad_bytes for m in members),
                sum(m.optim_bytes for m in members),
                sum(m.full_bytes for m in members),
            )
        )
    return out
