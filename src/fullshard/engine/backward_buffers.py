"""Pooled buffers in backward: those backward is done with, freed before the step ends; the
packed gradients that keep their pool memory between steps (:func:`mark_sole_sizes`).

After a unit reshards in backward, the buffers of sizes that only units already done use (their
full parameters, packed gradients, scratch) would sit idle in the pool through the rest of
backward, where a model with large embeddings peaks (167M GPT, 2 ranks: two 48 MiB block
buffers; issue 33). The planner's replay does the same (:mod:`fullshard.plan.schedule`).
"""

from __future__ import annotations

import torch

from fullshard.comm import buffers
from fullshard.engine.unit import ShardState, Unit


def drop_done_with(unit: Unit, order: list[Unit], backward_units: set[int]) -> None:
    """After ``unit`` resharded in backward: when no unit still to run backward will gather
    (typically only the root is left, gathered since forward), free the pooled buffers of the
    sizes only units already done use.

    Args:
        unit: the unit that just resharded.
        order: the root's units in forward order (the root first).
        backward_units: ``id`` of each unit whose output needed a gradient in this step (the
            others' backward never runs).
    """
    held = buffers.POOL.held_sizes()
    if not held or unit not in order or unit is order[0]:
        return  # nothing to free (at world size 1 the pool typically stays empty), or the root
    i = order.index(unit)
    # units backward never reaches (their output needed no gradient) gather nothing until forward
    rest = [u for u in order[:i] if id(u) in backward_units]
    done = order[i:] + [u for u in order[:i] if id(u) not in backward_units]
    if any(u.shard_state is ShardState.SHARDED and u.full_nbytes for u in rest):
        return  # a gather is still to come
    needed = {size for u in rest for size in u.pooled_sizes()}
    buffers.POOL.drop({size for u in done for size in u.pooled_sizes() if size in held} - needed)


def mark_sole_sizes(units: list[Unit]) -> None:
    """Let the gradient shards of each unit whose full buffer no other pooled buffer of the tree
    matches in size (numel and dtype: :meth:`~fullshard.engine.layout.UnitLayout.pooled_sizes`;
    all of its parameters trainable, so its packed gradient is that size too) stay in its packed
    gradient: the pool keeps that memory for it alone between steps
    (:meth:`~fullshard.engine.reduce.GradReducer._reduces_in_place`)."""
    sizes: dict[tuple[int, torch.dtype], int] = {}
    for u in units:
        for key in set(u.pooled_sizes()):
            sizes[key] = sizes.get(key, 0) + 1
    for u in units:
        own = u.pooled_sizes()  # full, packed, scratch...: the packed gradient the full size, no scratch of it
        u.grads.in_place = u.grad_numel == u.shard_numel > 0 and sizes[own[0]] == 1 and own.count(own[0]) == 2
