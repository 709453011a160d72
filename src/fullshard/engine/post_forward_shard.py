"""The post-forward shard: resharding to a smaller group after forward (FSDP2's
``reshard_after_forward=M``, its ``SHARDED_POST_FORWARD`` state).

Between a unit's forward and its backward, each rank keeps 1/M of every full parameter instead
of 1/N (M divides N, the shard group's size), so the backward all-gather runs within a group of
M ranks (the intra-node group, typically) instead of all N. The subgroups are blocks of M
consecutive ranks of the shard group; the member with index i keeps, of each parameter's N
padded shards, the q = N / M shards [i*q, (i+1)*q): one contiguous slice of the parameter's
region of the full flat buffer, so the member-major all-gather output is copied out into the full
buffer with one ``split_with_sizes_copy`` (parameter p's region viewed as (M, q * padded shard)).
A parameter sharded along a dim > 0 holds its full tensor in its region, not its shards, so the
slice a member keeps is the same 1/M of that region but no shard of it; the gather puts the
slices back as they were, with no rearranging: one copy per parameter, like the others.

The vocabulary (full flat buffer, padded shard, S) is :mod:`.layout`'s and :mod:`.sharded_param`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from fullshard.comm import buffers, collectives, custom_collectives
from fullshard.engine import custom_comm
from fullshard.engine.layout import UnitLayout


class PostForwardShard:
    """What one unit keeps between forward and backward under ``reshard_after_forward=M``.

    Args:
        unit: the unit's layout; its full flat buffer is read after forward and refilled by
            :meth:`gather` before backward.
        group: the subgroup of M consecutive ranks of the unit's shard group (M divides N).
    """

    def __init__(self, unit: UnitLayout, group: collectives.ProcessGroup) -> None:
        self.unit = unit
        self.group = group
        self.size = collectives.group_size(group)  # M
        self.per_param = unit.shard_size // self.size  # q: padded shards kept per parameter
        self.index = collectives.group_rank(group)  # this rank's index in the subgroup
        self.kept: torch.Tensor | None = None  # (q * S,) in the compute dtype, pooled memory

    def copy_mine(self) -> torch.Tensor:
        """This rank's 1/M of the full parameters, copied out of the full flat buffer into
        pooled memory (q * S elements). Call while the unit is UNSHARDED; hand the result to
        :meth:`hold` once the unit is resharded."""
        unit, q, i = self.unit, self.per_param, self.index
        parts = []
        for sp in unit.params:
            chunk = q * sp.spec.padded_shard_numel
            parts.append(unit.full_data[sp.full_offset + i * chunk : sp.full_offset + (i + 1) * chunk])
        kept = buffers.POOL.acquire(q * unit.shard_numel, unit.compute_dtype, unit.device)
        torch.cat(parts, out=kept)
        return kept

    def hold(self, kept: torch.Tensor) -> None:
        """Keep ``kept`` (from :meth:`copy_mine`) until backward gathers it or it is dropped."""
        self.drop()
        self.kept = kept

    def drop(self) -> None:
        """Give back what is kept (no backward came, or it was used)."""
        if self.kept is not None:
            buffers.POOL.release(self.kept)
            self.kept = None

    def gather(self, comm: Any = None, async_op: bool = True) -> collectives.Handle:
        """Start all-gathering the kept parts of the subgroup into the full flat buffer (its
        memory already allocated); the kept part goes back to the pool after the copy-out.

        ``comm``: the unit's custom all-gather (:mod:`.custom_comm`), which then gets the output
        from its ``allocate`` and is called with ``async_op``; None: fullshard's own."""
        m, q, kept = self.size, self.per_param, self.kept
        assert kept is not None, "gather without a kept part"
        self.kept = None
        if comm is None:
            out = buffers.POOL.acquire(m * kept.numel(), kept.dtype, kept.device)
            handle = collectives.all_gather(out, kept, self.group, async_op=True)
            assert handle is not None
        else:
            out = custom_comm.allocated(comm, m * kept.numel(), kept.dtype, kept.device, "set_custom_all_gather")
            own = out.view(m, -1)[self.index]
            own.copy_(kept)
            handle = custom_collectives.all_gather(comm, out, own, self.group, async_op=async_op)
        full, params = self.unit.full_data, self.unit.params
        sizes = [q * sp.spec.padded_shard_numel for sp in params]
        targets = [full[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(m, -1) for sp in params]

        def epilogue() -> None:
            torch.split_with_sizes_copy(out.view(m, -1), sizes, dim=1, out=targets)
            if comm is None:
                buffers.POOL.release(out)
            buffers.POOL.release(kept)

        return collectives.Handle([handle], epilogue)
