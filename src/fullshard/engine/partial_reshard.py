"""Resharding to a smaller group after forward (FSDP2's ``reshard_after_forward=M``).

Between a unit's forward and its backward, each rank keeps 1/M of every full parameter instead
of 1/N (M divides N, the shard group's size), so the backward all-gather runs within a group of
M ranks (the intra-node group, typically) instead of all N. The subgroups are blocks of M
consecutive ranks of the shard group; the member with index i keeps, of each parameter's N
padded shards, the q = N / M shards [i*q, (i+1)*q): one contiguous slice of the parameter's
region of the full flat buffer, so the member-major all-gather output is copied out into the full
buffer with one ``split_with_sizes_copy`` (parameter p's region viewed as (M, q * padded shard)).

The vocabulary (full flat buffer, padded shard, S) is ``_unit``'s and ``_sharded_param``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fullshard.comm import buffers, collectives

if TYPE_CHECKING:
    from fullshard.engine.unit import Unit


def _geometry(unit: Unit) -> tuple[int, int, int]:
    """(M, q, i): the subgroup's size, shards kept per parameter, this rank's index in it."""
    group = unit.post_forward_group
    assert group is not None
    m = collectives.group_size(group)
    return m, unit.world // m, collectives.group_rank(group)


def keep_partial(unit: Unit) -> None:
    """After forward: keep this rank's 1/M of the full parameters (q * S elements, pooled
    memory), then reshard. Call only while UNSHARDED."""
    m, q, i = _geometry(unit)
    parts = []
    for sp in unit.params:
        chunk = q * sp.spec.padded_shard_numel
        parts.append(unit._full_data[sp.full_offset + i * chunk : sp.full_offset + (i + 1) * chunk])
    kept = buffers.POOL.take(q * unit.shard_numel, unit.compute_dtype, unit.device)
    torch.cat(parts, out=kept)
    unit.reshard()
    unit._partial = kept


def drop_partial(unit: Unit) -> None:
    """Give back what :func:`keep_partial` kept (no backward came, or it was used)."""
    if unit._partial is not None:
        buffers.POOL.give(unit._partial)
        unit._partial = None


def gather_partial(unit: Unit) -> collectives.Handle:
    """Start all-gathering the kept parts of the subgroup into the full flat buffer (its memory
    already allocated); the kept part goes back to the pool when the copy-out is done."""
    m, q, _ = _geometry(unit)
    kept = unit._partial
    assert kept is not None
    unit._partial = None
    out = buffers.POOL.take(m * kept.numel(), kept.dtype, kept.device)
    handle = collectives.all_gather(out, kept, unit.post_forward_group, async_op=True)
    assert handle is not None
    full = unit._full_data
    sizes = [q * sp.spec.padded_shard_numel for sp in unit.params]
    targets = [full[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(m, -1) for sp in unit.params]

    def epilogue() -> None:
        torch.split_with_sizes_copy(out.view(m, -1), sizes, dim=1, out=targets)
        buffers.POOL.give(out)
        buffers.POOL.give(kept)

    return collectives.Handle([handle], epilogue)
