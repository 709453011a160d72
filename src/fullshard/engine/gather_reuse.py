"""When a forward may use a unit's full parameters still gathered by an earlier forward.

A unit kept gathered after forward (``reshard_after_forward=False``, a root that keeps its
parameters) whose forward is followed by another before its backward (the micro-batches a
pipeline schedule runs forward first, or a forward whose output is kept for later) would be
gathered again by the root's tidy-up (:func:`~fullshard.engine.hooks.root_pre_forward`), lest it
serve parameters an optimizer step has changed since. It is reused instead while the gathered
values are still the shards': their version counters
(:func:`~fullshard.engine.shard_sync.shards_version`: an optimizer step, ``load_state_dict``, any
in-place change bumps them) read the same as when the all-gather read them, and nothing that
:func:`~fullshard.engine.shard_sync.sync_shards` would take back or lay out again (a replaced
shard or parameter, a ``requires_grad`` or dtype change).

Reading the versions is a pass over the parameters at every all-gather, which an ordinary step
(each forward followed by its backward) never needs: a unit records them
(``Unit.records_gathered_version``) only once a forward has found it still gathered by an earlier
one (:func:`note_kept_gathered`); that first time it is gathered again. Neither test asks whether
a graph of the earlier forward awaits backward (until 2026-11-29 both did): that depends on the
rank where one rank keeps an output (an evaluation's, with grad, for logging) and the others drop
it, and the ranks then paired the root's all-gather with another unit's (FSDP1's root stays
gathered after forward: tests/test_checkpoint_in_unit.py, "kept").

Never a unit under ``set_reduce_scatter_unused_params(True)``: whether a graph of its forward
awaits backward depends on the rank (where backward does not reach it, none does), so reusing it
on some ranks and gathering it again on the others would pair the ranks' all-gathers crosswise
(found by review on 2026-11-29: a root called twice in one step, ``enc(tanh(enc(x)))``). It is
gathered again at each such forward, on every rank.
"""

from __future__ import annotations

from fullshard.engine import shard_sync, unreached_reshard
from fullshard.engine.unit import ShardState, Unit


def reusable_gathered(unit: Unit) -> bool:
    """Whether a forward may use the full parameters ``unit`` holds, gathered by an earlier
    forward, without gathering again (see the module's note). A unit whose full parameters are its
    shards (or that has none) holds no copy to go stale."""
    if unit.shard_state is not ShardState.UNSHARDED or unit.has_pending_gather:
        return False
    if unit.aliased or unit.shard_numel == 0:
        return shard_sync.shards_in_place(unit)
    return (
        unit.gathered_version is not None
        and not unreached_reshard.defers_reshard(unit)
        and shard_sync.shards_in_place(unit)
        and shard_sync.shards_version(unit) == unit.gathered_version
    )


def note_kept_gathered(unit: Unit) -> None:
    """``unit`` was found gathered by an earlier forward and cannot be reused: record the shards'
    version at its all-gathers from now on. Not for a flagged unit, which is never reused:
    reading the versions would be wasted work."""
    if not unreached_reshard.defers_reshard(unit):
        unit.records_gathered_version = True
