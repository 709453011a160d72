"""A unit's gradient that a nested backward accumulates before the rest of the unit's backward.

A reentrant activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``, or
``checkpoint_wrapper`` with ``CheckpointImpl.REENTRANT``) recomputes its segment in the middle
of the outer backward and runs that segment's backward at once, as a backward of its own (its
own autograd graph task). Where the segment is a child module inside a unit, that nested
backward accumulates the child's gradients into the unit's full flat gradient, and the unit's
gradient-ready hook fires before the outer backward has reached the rest of the unit. The
post-backward there reduce-scattered a partial gradient and resharded the unit, and the outer
backward then found the unit's full parameters freed (or a second segment of the unit
recomputed on its shards).

So in a nested backward, a unit's post-backward waits (:func:`grad_ready`) when

- the gradient came from a child's recomputation: the full parameters the pre-backward hook
  installed (untracked split nodes, :meth:`~.unit.Unit.install_full_params`; marked in
  :data:`~.split_full.CHILD_GRAD`), not a forward of the unit's own (the segment is not the
  whole unit), so more of the unit's gradient may come;
- or one of the unit's split nodes from its forward with grad that the outer backward will run
  (noted at the backward's first pre-backward, :func:`note_awaited`) has not run yet: a unit
  called in a segment and outside it, the segment last in forward.

It runs at the hook's next firing that meets neither, when the outer backward's nodes have
added theirs: one reduce-scatter of the whole gradient, as torch's ``fully_shard`` does, with
the unit gathered until then. Where no split node of its own is to come (the unit's parameters
used in segments alone, e.g. ``checkpoint_wrapper(..., CheckpointImpl.REENTRANT)`` around a
unit's whole body), it runs at the outer backward's next pre-backward or post-backward of
another unit of the tree that does not run inside it (:func:`release_waiting`: typically the
unit before it in forward, whose output's gradient the segments computed last; never for the
root), so that units reshard one after another as before, or at the backward's end (:func:`flush_deferred`), before the
reductions of the units it did not reach. A split node of a graph this backward does not run (a
forward with grad whose output was kept, never backwarded) is not waited for.

Limits: a unit whose segments' backwards come with another unit's pre-backward between them (a
branch) reshards at that pre-backward, and its next segment's recomputation then fails as it did
before 2026-11-29. Where ranks differ in which of a unit's children they checkpoint, the unit's
reduce-scatter comes at the same point of the outer backward either way in a chain of units.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from fullshard import compat
from fullshard.engine import reshard_guard
from fullshard.engine.split_full import CHILD_GRAD

if TYPE_CHECKING:
    from fullshard.engine.hook_state import RootState
    from fullshard.engine.unit import Unit

__all__ = ["flush_deferred", "grad_ready", "note_awaited", "release_waiting"]

PostBackward = Callable[["Unit", "RootState"], None]


def note_awaited(units: Iterable[Unit]) -> None:
    """At a backward's first pre-backward of a tree: mark each open split node of ``units`` that
    this backward will run (``ctx.awaited``); its own backward clears the mark."""
    for unit in units:
        for ctx in list(unit._open_splits):
            try:
                ctx.awaited = compat.will_backward_run(ctx)
            except RuntimeError:  # not a node of an engine's graph task (e.g. compiled autograd's)
                ctx.awaited = False


def _awaits_split(unit: Unit) -> bool:
    """Whether a split node of ``unit`` that this backward will run has yet to run."""
    return any(getattr(c, "awaited", False) for c in unit._open_splits)


def grad_ready(unit: Unit, root: RootState, post_backward: PostBackward) -> None:
    """``unit``'s full flat gradient has been accumulated: run ``post_backward`` unless the
    module docstring's rule makes it wait (then ``unit`` waits in ``root.deferred_grads``)."""
    child = unit in CHILD_GRAD
    CHILD_GRAD.discard(unit)
    if reshard_guard.nested_backward() and (child or _awaits_split(unit)):
        if unit not in root.deferred_grads:
            root.deferred_grads.append(unit)
        return
    if unit in root.deferred_grads:
        root.deferred_grads.remove(unit)
    release_waiting(root, post_backward, unit)
    post_backward(unit, root)


def release_waiting(root: RootState, post_backward: PostBackward, current: Unit) -> None:
    """At a pre-backward or post-backward of ``current`` in the outer backward: the
    post-backward of each unit waiting for a child segment's recomputation alone (no split node
    of its own to come), but ``current``'s (whose other outputs' segments may still come) and
    those ``current`` runs inside (the root's blocks between its units: seed 770001 case 23)."""
    if not root.deferred_grads or reshard_guard.nested_backward():
        return
    for unit in list(root.deferred_grads):
        if unit is not current and not _awaits_split(unit) and not _inside(current, unit, root):
            root.deferred_grads.remove(unit)
            post_backward(unit, root)


def _inside(current: Unit, unit: Unit, root: RootState) -> bool:
    """Whether ``current`` runs inside ``unit``'s forward (``unit`` is the root, or an ancestor
    module of ``current``'s), so that ``unit``'s segments may come after ``current``'s hooks."""
    return unit is root.units[0] or current.name.startswith(unit.name + ".")


def flush_deferred(root: RootState, post_backward: PostBackward) -> None:
    """At backward's end: the post-backward of each unit still waiting, in the order they waited."""
    waiting, root.deferred_grads = root.deferred_grads, []
    for unit in waiting:
        post_backward(unit, root)
