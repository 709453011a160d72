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

So, in a nested backward:

- where one of the unit's split nodes from its forward with grad that the outer backward will
  run (noted at the backward's first pre-backward, :func:`note_awaited`) has not run yet, the
  unit's post-backward waits (:func:`grad_ready`) for the hook's next firing, when that node
  has added its part: one reduce-scatter of the whole gradient, as torch's ``fully_shard``
  does, with the unit gathered until then (or at the backward's end, :func:`flush_deferred`,
  should none come). A ``torch.checkpoint`` of a child between other layers of the unit, or a
  unit called in a segment and outside it, the segment last in forward;
- where the gradient came from a child's recomputation alone (the full parameters the
  pre-backward hook installed: untracked split nodes, marked in
  :data:`~.split_full.CHILD_GRAD`; the unit's parameters used inside segments alone, e.g. a
  checkpoint around its whole body), the post-backward runs at once, as before 2026-11-29, but
  the unit stays gathered (a second segment of it may still recompute) until a hook of a unit
  that does not run inside it (:func:`release_held`: its forward in a recomputation, its
  pre-backward or post-backward, before that hook's collectives; typically the unit before it
  in forward; never for the root, whose blocks may come between its units) or backward's end.
  Its reduce-scatters come where they came before, so ranks that checkpoint a unit and ranks
  that do not issue the same collectives (a reshard is no collective); a unit with two such
  segments reduce-scatters twice (the second gradient as a unit reached twice).

A unit's recomputation or pre-backward after its post-backward in the same backward (two
forwards before one backward, each with the unit in a segment) gathers it again and reduces
once more (:func:`reopen`), except in a tree with a flagged unit.

A split node of a graph this backward does not run (a forward with grad whose output was kept,
never backwarded) is not waited for. Limits: a unit whose two segments' backwards come with the
hook of a unit outside it between them (a branch) reshards there, and its next segment's
recomputation fails as it did before; ranks that differ in how many of a unit's segments they
run (a checkpointed block some ranks skip, under an unflagged unit) reduce-scatter it a
different number of times, as a unit reached twice on some ranks only (gloo aborts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from fullshard import compat
from fullshard.engine import reshard_guard
from fullshard.engine.split_full import CHILD_GRAD
from fullshard.engine.unit import ShardState, TrainingState

if TYPE_CHECKING:
    from fullshard.engine.hook_state import RootState
    from fullshard.engine.unit import Unit

__all__ = [
    "enter_forward",
    "enter_backward",
    "flush_deferred",
    "grad_ready",
    "holds",
    "note_awaited",
    "release_held",
    "reopen",
]

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
    module docstring's rule makes it wait (then ``unit`` waits in ``root.deferred_grads``); a
    child segment's gradient keeps the unit gathered (``root.held_gathered``)."""
    child = unit in CHILD_GRAD
    CHILD_GRAD.discard(unit)
    nested = reshard_guard.nested_backward()
    if nested and _awaits_split(unit):
        if unit not in root.deferred_grads:
            root.deferred_grads.append(unit)
        return
    if unit in root.deferred_grads:
        root.deferred_grads.remove(unit)
    release_held(root, unit)
    if nested and child and unit not in root.held_gathered:
        root.held_gathered.append(unit)
    if nested:
        root.nested_posts.add(id(unit))
    post_backward(unit, root)


def holds(unit: Unit, root: RootState) -> bool:
    """Whether ``unit``'s post-backward leaves it gathered (a child segment's gradient)."""
    return unit in root.held_gathered


def release_held(root: RootState, current: Unit) -> None:
    """At a hook of ``current`` in backward (its forward in a recomputation, its pre-backward or
    post-backward), before the hook's collectives: reshard each unit held gathered after a child
    segment's gradient, but ``current`` and those ``current`` runs inside (the root, or an
    ancestor module by name: their other segments may come after ``current``'s hooks)."""
    for unit in list(root.held_gathered):
        if unit is current or unit is root.units[0] or current.name.startswith(unit.name + "."):
            continue
        root.held_gathered.remove(unit)
        if unit.shard_state is ShardState.UNSHARDED and unit.reshard_after_backward:
            unit.reshard()


def flush_deferred(root: RootState, post_backward: PostBackward) -> None:
    """At backward's end: the post-backward of each unit still waiting, in the order they waited."""
    waiting, root.deferred_grads = root.deferred_grads, []
    for unit in waiting:
        post_backward(unit, root)


def reopen(unit: Unit, root: RootState, allowed: bool = True) -> None:
    """``unit``'s forward or pre-backward in backward after its post-backward in that backward:
    a second reentrant checkpoint's recomputation of it, or of a child inside it (two forwards
    before one backward, each with the unit in a segment: HF's reentrant gradient checkpointing
    under a contrastive loss; or the unit in a segment and called again after it). It runs as
    the first did, gathered again where it was resharded, its post-backward coming again with
    that segment's gradient (a second reduce-scatter, added to the first, as for a unit reached
    twice). Not in a tree with a unit that reduces where it is not reached
    (``reduce_unreached``): its turns and late round assume one post-backward per graph task and
    unit (a flagged unit reached on one rank paired collectives crosswise); there, and outside
    backward, the state check's error stands. At a pre-backward (:func:`enter_backward`), only
    the first of another forward call's output hooks, after a post-backward in a nested backward
    (``allowed``). Not a hook on an output that is one of the unit's inputs (T5's
    ``position_bias``, which every block returns; an ``nn.Identity`` member of a unit), reached
    after an ordinary post-backward with nothing more to accumulate: gathered again there, the
    unit stayed so to backward's end (reviews, 2026-11-29)."""
    if unit.training_state is TrainingState.POST_BACKWARD and compat.in_backward() and allowed:
        if not any(u.grads.reduce_unreached for u in root.units):
            unit.training_state = TrainingState.IDLE
            root.pre_backward_done.discard(id(unit))


def enter_backward(unit: Unit, root: RootState, call: list[bool]) -> None:
    """At a pre-backward hook of ``unit`` on an output of one forward call (``call``: shared by
    that call's hooks, non-empty once one of them ran): release the units held for a child
    segment (:func:`release_held`), and :func:`reopen` ``unit`` at the call's first hook where its
    post-backward in this backward ran in a nested one."""
    release_held(root, unit)
    reopen(unit, root, allowed=not call and id(unit) in root.nested_posts)
    call.append(True)


def enter_forward(unit: Unit, root: RootState) -> None:
    """At ``unit``'s pre-forward, before its state check: :func:`reopen` it, and in a
    recomputation (a forward in backward) release the units held before it (done with)."""
    reopen(unit, root)
    if root.held_gathered and compat.in_backward():
        release_held(root, unit)
