"""A unit's gradient that a nested backward accumulates before the rest of the unit's backward.

A reentrant activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``, or
``checkpoint_wrapper`` with ``CheckpointImpl.REENTRANT``) recomputes its segment in the middle
of the outer backward and runs that segment's backward at once, as a backward of its own (its
own autograd graph task). Where the segment is a child module inside a unit, that nested
backward accumulates the child's gradients into the unit's full flat gradient, and the unit's
gradient-ready hook fires before the outer backward has reached the rest of the unit (the
nodes its own forward made). The post-backward there reduce-scattered a partial gradient and
resharded the unit, and the outer backward then found the unit's full parameters freed.

So a gradient that arrives in a nested backward while one of the unit's split nodes from its
forward with grad has yet to run its backward (``Unit._open_splits``) leaves the post-backward
to the hook's next firing, when the outer backward's nodes have added theirs: one
reduce-scatter of the whole gradient, as torch's ``fully_shard`` does, with the unit gathered
until then. A unit called both inside such a segment and outside it (the segment's backward
first) is the same case. Where the open node is of a graph this backward never reaches (a
forward with grad whose output was dropped), the backward's end runs the post-backward
(:func:`flush_deferred`), before the reductions of the units it did not reach.
"""

from __future__ import annotations

from collections.abc import Callable

from fullshard.engine import reshard_guard
from fullshard.engine.hook_state import RootState
from fullshard.engine.unit import Unit

__all__ = ["flush_deferred", "grad_ready"]

PostBackward = Callable[[Unit, RootState], None]


def grad_ready(unit: Unit, root: RootState, post_backward: PostBackward) -> None:
    """``unit``'s full flat gradient has been accumulated: run ``post_backward`` unless a nested
    backward is running and a split node of ``unit``'s forward has yet to run its backward (then
    the unit waits in ``root.deferred_grads``)."""
    if reshard_guard.nested_backward() and unit._open_splits:
        if unit not in root.deferred_grads:
            root.deferred_grads.append(unit)
        return
    if unit in root.deferred_grads:
        root.deferred_grads.remove(unit)
    post_backward(unit, root)


def flush_deferred(root: RootState, post_backward: PostBackward) -> None:
    """At backward's end: the post-backward of each unit still waiting, in the order they waited."""
    waiting, root.deferred_grads = root.deferred_grads, []
    for unit in waiting:
        post_backward(unit, root)
