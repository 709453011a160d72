"""When a unit under ``set_reduce_scatter_unused_params(True)`` reshards after backward.

Such a unit (``unit.grads.reduce_unreached``, *flagged*) is one that backward may reach on some
ranks only, or reach with its parameters unused there: its post-backward fires only on the
ranks whose backward gave one of its parameters a gradient. A reshard in that post-backward
therefore leaves it sharded on some ranks and gathered on the others, and wherever backward
needs it again before the next forward, the ranks that resharded it all-gather it and the
others do not: a hang, or with units of one size crosswise pairs and wrong gradients. Backward
needs it again after its post-backward in a reentrant checkpoint segment's nested backward
(its own graph task) followed by the outer one, and in a second backward through a retained
graph (``retain_graph=True``, two losses over one output). A unit called twice in one forward
is not such a case: autograd accumulates each parameter's gradient once, after both calls'
backward, so its post-backward comes once, at the end.

So:

- a flagged unit reshards at backward's end, on every rank (:func:`defers_reshard`; the end
  callback reshards every unit), as the ranks its post-backward does not reach already did;
- a backward that begins while a flagged unit kept gathered after forward is sharded (an
  earlier backward of the same forward resharded it at its end) all-gathers it first, on every
  rank, before anything of this backward's is issued (:func:`regather_for_backward`).

Where the last node of a unit's forward graph runs its backward, ``Unit.reshard_for_packing``
may still reshard it on the ranks that reach it: no later part of that backward reads its full
parameters, so none gathers them again. ``SplitFull.backward`` skips that for a flagged unit in
a backward that creates a graph (whose end reshards nothing) and, for every unit, in a retained
graph's later backward (whose other nodes may read them yet).

The cost: the flagged unit's full parameters stay from its post-backward to backward's end on
the ranks that reach it, as they already did on the others; a retained graph's later backward
gathers such a unit even where no rank reaches it.
"""

from __future__ import annotations

from fullshard.engine.hook_state import RootState
from fullshard.engine.unit import ShardState, Unit


def defers_reshard(unit: Unit) -> bool:
    """Whether ``unit``'s post-backward leaves its reshard to backward's end (it is flagged)."""
    return unit.grads.reduce_unreached


def regather_for_backward(root: RootState) -> None:
    """At the first pre-backward of a backward of ``root``'s tree: all-gather each flagged unit
    that stays gathered after forward (``reshard_after_forward=False``), ran in the last forward
    with grad (not only without grad: in a reentrant checkpoint's first pass, whose recomputation
    gathers it; :func:`~.hooks.pre_forward` takes a unit run again with grad off that list),
    and is sharded now, so that the ranks this backward reaches it on gather nothing of their
    own. Its next reshard is at this backward's end."""
    for unit in root.forward_order:
        if (
            defers_reshard(unit)
            and not unit.reshard_after_forward
            and id(unit) not in root.forward_without_grad
            and unit.shard_state is ShardState.SHARDED
            and not unit.has_pending_gather
        ):
            unit.unshard()
