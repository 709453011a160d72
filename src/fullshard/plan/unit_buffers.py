"""The buffers one FSDP unit needs on a rank (gathered parameters, all-gather scratch, packed
and sharded gradients), from the unwrapped model's shapes and fullshard's own shard geometry
and gather layout; :mod:`fullshard.plan.schedule` replays them through a traced step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from fullshard.engine.layout import gather_pieces
from fullshard.engine.sharded_param import ShardSpec, one_rank_align
from fullshard.plan.estimate import owned_params

ROOT = "<root>"


@dataclasses.dataclass(frozen=True)
class UnitBuffers:
    """The buffers one unit needs on a rank (numels; itemsizes in bytes).

    ``full``: the full flat buffer's numel (0 when it aliases the shards: one rank, no cast);
    ``scratch``: the all-gather's scratch numels (runs of small parameters, world > 1);
    ``packed``: the packed gradient's numel (``world x S_t``); ``shard_grad``: ``S_t``;
    ``compute``/``reduce``/``param``: itemsizes of the compute, reduction and parameter dtypes.
    """

    name: str
    full: int
    scratch: tuple[int, ...]
    packed: int
    shard_grad: int
    compute: int
    reduce: int
    param: int


def unit_buffers(
    model: nn.Module,
    is_unit: Callable[[nn.Module], bool],
    world_size: int,
    *,
    sharding_strategy: str = "full_shard",
    param_dtype: torch.dtype | None = None,
    groups: Sequence[Sequence[str]] = (),
    offload: bool = False,
    full_precision: Collection[str] = (),
) -> list[UnitBuffers]:
    """Each unit's :class:`UnitBuffers` on rank 0 (gloo; mixed precision reduces in
    ``param_dtype``), in the order of :func:`~fullshard.plan.estimate.owned_params`; each of
    ``groups`` (unit names) is one unit of its members' parameters, named after its first.
    ``offload``: shards on the host, so even one rank gathers a full copy. ``full_precision``:
    names of units that gather, compute and reduce in their own dtype whatever
    ``param_dtype`` says (the wrapper's BatchNorm units under mixed precision)."""
    world = 1 if sharding_strategy == "no_shard" else world_size
    out = []
    for name, params in grouped_params(owned_params(model, is_unit), groups).items():
        dtype = params[0].dtype if params else torch.float32
        compute_dtype = dtype if name in full_precision else param_dtype or dtype
        compute = compute_dtype.itemsize
        align = one_rank_align(world, dtype, compute_dtype)  # as the layout pads (ShardSpec.align)
        specs = [(ShardSpec(p.shape, world, 0, 0, align), p) for p in params]
        shard = sum(s.padded_shard_numel for s, _ in specs)
        trainable = sum(s.padded_shard_numel for s, p in specs if p.requires_grad)
        aliased = world == 1 and compute == dtype.itemsize and not offload
        # The layout's gather pieces (trainable parameters first, as the layout orders them): a
        # piece of several parameters goes through a scratch buffer of world x its elements.
        numels = [s.padded_shard_numel for s, _ in sorted(specs, key=lambda sp: not sp[1].requires_grad)]
        pieces = gather_pieces([n * compute for n in numels], direct=True)
        runs = [sum(numels[i] for i in piece) for piece in pieces if len(piece) > 1]
        scratch = tuple(world * r for r in runs if r) if world > 1 and shard else ()
        out.append(
            UnitBuffers(
                name or ROOT,
                0 if aliased or not shard else world * shard,
                scratch,
                world * trainable,
                trainable,
                compute,
                compute,
                dtype.itemsize,
            )
        )
    return out


def grouped_params(
    owned: dict[str, list[nn.Parameter]], groups: Sequence[Sequence[str]]
) -> dict[str, list[nn.Parameter]]:
    """``owned`` (unit name -> parameters, "" the root) with each of ``groups`` merged into its
    first member, parameters in the members' order (as ``fully_shard`` of a list lays them out).

    Raises:
        KeyError: a group names a unit ``owned`` does not have.
    """
    head = {n: g[0] for g in groups for n in g}
    missing = [n for n in head if n not in owned]
    if missing:
        raise KeyError(f"groups name {missing} that are not units ({', '.join(owned)})")
    out: dict[str, list[nn.Parameter]] = {}
    for name, params in owned.items():
        out.setdefault(head.get(name, name), []).extend(params)
    return out
