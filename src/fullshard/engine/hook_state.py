"""The state the hooks keep: :class:`RootState` (what the units of one FSDP tree share) and
:class:`FSDPState` (the state of a module that heads a unit), and the orders read from them
(:func:`neighbour`, :func:`backward_neighbour`). :mod:`fullshard.engine.hooks` reads and updates
them and re-exports the classes."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from torch import nn

from fullshard.engine.config import BackwardPrefetch, FrontEnd, MixedPrecision
from fullshard.engine.unit import Unit


@dataclasses.dataclass
class ReduceTurns:
    """This backward's fixed order of reductions (:mod:`fullshard.engine.reduce_order`): the
    units that take turns, the turn of each (by id), the next turn to launch, the units (by id)
    whose gradients are ready but whose turn has not come, and those reached again after their
    reduction launched (their gradients wait for the late round). ``hold_from``: the first turn
    that waits for backward's end, with every later one (``len(units)``: none waits)."""

    units: list[Unit]
    turn: dict[int, int]
    hold_from: int
    next: int = 0
    ready: set[int] = dataclasses.field(default_factory=set)
    late: set[int] = dataclasses.field(default_factory=set)


# Each RootState's serial, in the order the roots are made (the same on every rank running one
# program): :mod:`fullshard.engine.reduce_order` keys the roots with a backward to come by it.
_SERIALS = itertools.count()


@dataclasses.dataclass
class RootState:
    """What the units of one FSDP tree share; owned by the root unit."""

    units: list[Unit]
    states: list[FSDPState]  # the state of each unit, in ``units``' order
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    forward_order: list[Unit] = dataclasses.field(default_factory=list)
    last_forward_order: list[Unit] = dataclasses.field(default_factory=list)
    callback_queued: bool = False
    last_reduced: Unit | None = None
    # This backward's reduction turns (reduce_order), made at its first reduction; None between backwards.
    turns: ReduceTurns | None = None
    serial: int = dataclasses.field(default_factory=lambda: next(_SERIALS))
    pre_backward_done: set[int] = dataclasses.field(default_factory=set)
    post_optim_event: Any = None  # a CUDA event the next forward's all-gathers wait for
    units_checked: bool = False  # whether every rank was found to wrap the same units
    # Left gathered after forward by keeps_last_gathered, or prefetched by the root's pre-backward:
    # the unit expected first in backward, released if another unit's backward comes first.
    kept: Unit | None = None
    # During a root forward without grad: the reshard_after_forward=False units it left gathered
    # (a second call in the same forward gathers nothing), resharded when that forward ends.
    held_without_grad: list[Unit] | None = None
    # Per unit without trainable parameters (by id): its forward calls whose inputs backward has
    # not reached yet (engine.frozen_backward).
    frozen_pending: dict[int, int] = dataclasses.field(default_factory=dict)
    # The units (by id) whose output this step required grad: the ones backward reaches.
    backward_units: set[int] = dataclasses.field(default_factory=set)
    # Whether the root's forward with grad is running, and the units (by id) that ran forward
    # without grad inside it (reentrant activation checkpointing: their backward comes with
    # their recomputation, so backward prefetches them when they ran backward the last step,
    # ``last_backward``: the units whose pre-backward ran then; before the tree's first backward,
    # every such unit, so that ranks that checkpoint a unit and ranks that do not prefetch alike).
    grad_pass: bool = False
    forward_without_grad: set[int] = dataclasses.field(default_factory=set)
    last_backward: set[int] | None = None
    # The units (by id) FSDPModule.unshard gathered since the last root forward began, with the
    # version of their local shards then: the next root forward keeps those still gathered (as
    # torch's) unless an optimizer step changed the shards since.
    gathered_by_hand: dict[int, int] = dataclasses.field(default_factory=dict)
    # Units whose gradient arrived in a nested backward before the rest of their own backward
    # (engine.nested_grad): their post-backward waits for it, or for this backward's end.
    deferred_grads: list[Unit] = dataclasses.field(default_factory=list)
    # Units a child segment's gradient reached, gathered until a hook of a unit outside them.
    held_gathered: list[Unit] = dataclasses.field(default_factory=list)
    # Units (by id) whose post-backward ran in a nested backward (a reentrant checkpoint's) in this
    # backward: their next forward call's pre-backward may reopen them (nested_grad.reopen).
    nested_posts: set[int] = dataclasses.field(default_factory=set)

    def forget_backward(self) -> None:
        """Drop what one backward recorded (its end, or an abandoned iteration's reset)."""
        self.pre_backward_done.clear()
        self.frozen_pending.clear()
        self.backward_units.clear()
        self.deferred_grads.clear()  # engine.nested_grad's
        self.held_gathered.clear()
        self.nested_posts.clear()

    def expected_backward(self) -> set[int]:
        """The units (by id) backward is expected to reach this step (not to be changed)."""
        if not self.forward_without_grad:
            return self.backward_units
        if self.last_backward is None:
            return self.backward_units | self.forward_without_grad
        return self.backward_units | (self.forward_without_grad & self.last_backward)


@dataclasses.dataclass
class FSDPState:
    """The FSDP state of a module that heads a unit (FSDP2's ``FSDPState``): the unit, the front
    end that built it, whether it is the root, and its tree's shared state. ``ignored``: the
    modules the unit's front end leaves alone (FullyShardedDataParallel's ``ignored_modules``),
    for the state-dict code."""

    unit: Unit
    front_end: FrontEnd
    ignored: frozenset[nn.Module] = frozenset()
    is_root: bool = False
    root: RootState | None = None
    mixed_precision: MixedPrecision | None = None
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    # Set by FSDPModule.set_modules_to_{forward,backward}_prefetch: the units whose all-gathers
    # this unit's forward / backward starts, instead of the neighbour in the recorded order.
    prefetch_in_forward: list[Unit] | None = None
    prefetch_in_backward: list[Unit] | None = None
    forward_range: Any = None  # the open torch.profiler range of this unit's forward
    # fully_shard of several modules: the ids of those still to run forward in this pass over
    # the unit (torch's ``modules_to_run``); the unit's post-forward runs when it empties, or
    # at the end of the root's forward for a pass that some member never joined.
    modules_to_run: set[int] = dataclasses.field(default_factory=set)
    # How many calls of methods registered with register_fsdp_forward_method are running on the
    # unit: a forward called inside one (``generate`` calling ``self(...)``) does not end the
    # pass, so the method goes on with the full parameters; the method's own end does.
    methods_running: int = 0


def neighbour(order: list[Unit], unit: Unit, step: int) -> Unit | None:
    """The unit ``step`` places from ``unit`` in ``order``, if any."""
    try:
        i = order.index(unit)
    except ValueError:
        return None
    j = i + step
    return order[j] if 0 <= j < len(order) else None


def backward_neighbour(root: RootState, unit: Unit, first: bool = False) -> Unit | None:
    """The unit backward reaches after ``unit``: the nearest before it in forward order whose
    output required grad (one that needed none, a frozen vision tower, never runs backward).
    ``first``: ``unit`` is the root, whose backward starts first: the last unit of forward (the
    root's forward ends after every other's, as torch's post-forward order has it)."""
    try:
        i = root.forward_order.index(unit)
    except ValueError:
        return None
    expected = root.expected_backward()
    before = root.forward_order[1:] if first else root.forward_order[:i]
    return next((u for u in reversed(before) if id(u) in expected), None)
