"""What ``torch.distributed.pipelining`` reads of a ``fully_shard`` unit.

torch's pipeline stages treat a stage module that is a torch ``FSDPModule`` (fullshard's units
are) as FSDP2's: each micro-batch's backward runs with gradient sync and resharding after
backward off, so gradients accumulate unsharded, and the schedule's REDUCE_GRAD action
(``PipelineStage.perform_reduce_grad``) turns both back on, then reaches the unit's state
through ``fully_shard.state(stage_module)``: it calls ``post_backward()`` on every parameter
group of every state in the stage's tree, then the root's final backward callback. That is one
reduction per unit per step, as with torch's FSDP2.

torch's ``fully_shard.state`` knows only torch's states, so the stage module binds fullshard's
``fully_shard`` (:func:`fullshard.use_in_torch` rebinds it there), whose ``state`` attribute is
:func:`state`: for a fullshard unit, a :class:`PipelineState` with the few names the stage reads;
for any other module, torch's answer.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from torch import nn

from fullshard import compat
from fullshard.engine import hooks, reduce_order
from fullshard.engine.unit import Unit

# The module of torch's whose ``fully_shard`` name must be fullshard's for REDUCE_GRAD to work.
STAGE_MODULE = "torch.distributed.pipelining.stage"
SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"


class UnitReduction:
    """One unit, as the stage sees one of torch's parameter groups."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    def post_backward(self, fill_unreached: bool = True) -> None:
        """Launch the reduction of what the unit accumulated while gradient sync was off (none
        when sync is still off or one is in flight). A unit no micro-batch's backward reached
        on this rank reduces zeros under ``set_reduce_scatter_unused_params(True)``
        (``fill_unreached``), as at the end of an ordinary backward: every data-parallel rank
        then launches the same reduce-scatters; otherwise it reduces nothing."""
        unit = self.unit
        if not unit.sync_grads or unit.has_pending_reduce:
            return
        if fill_unreached and unit.grads.reduce_unreached:
            unit.grads.fill_zeros()  # a no-op where gradients were accumulated
        if unit.grads.holds_unreduced:
            unit.reduce_grads()


class UnitState:
    """One unit's FSDP state, as the stage sees torch's: ``_fsdp_param_groups`` is its unit."""

    def __init__(self, unit: Unit) -> None:
        self._fsdp_param_groups = [UnitReduction(unit)]
        self._fsdp_param_group = self._fsdp_param_groups[0]  # the name older stages read


class StateContext:
    """The states of a root's tree (``all_states``), one per unit, in the root's order."""

    def __init__(self, units: list[Unit]) -> None:
        self.all_states = [UnitState(u) for u in units]


class PipelineState:
    """``fully_shard.state(module)`` for a fullshard unit, read by torch's pipeline stage.

    ``_state_ctx.all_states``: a state per unit of the tree ``module`` belongs to (empty before
    the first forward); ``_root_post_backward_final_callback()``: reduce what is left, wait for
    every reduction, reshard the units that reshard after backward, all back to IDLE.
    """

    def __init__(self, module: nn.Module) -> None:
        own = hooks.fsdp_state(module)
        assert own is not None, "PipelineState of a module that heads no unit"
        self._root = own.root
        self._state_ctx = StateContext(self._root.units if self._root is not None else [])

    def _root_post_backward_final_callback(self) -> None:
        if self._root is None:
            return
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward(fill_unreached=False)  # the stage's own calls filled them
        reduce_order.settle_unused(self._root)
        hooks.finish_backward(self._root)


def state(module: nn.Module) -> Any:
    """``fully_shard.state``: a :class:`PipelineState` for a module ``fully_shard`` sharded,
    torch's ``fully_shard.state(module)`` for any other (a torch FSDP2 module, or None).

    Args:
        module: any module.

    Returns:
        the state torch's pipeline stage reads, or torch's (None for a module neither sharded).
    """
    if hooks.is_unit(module):
        return PipelineState(module)
    return compat.torch_fsdp2_state(module)


_SPLIT_BACKWARD = (
    "torch.distributed.pipelining's split backward (backward_input / backward_weight, used by "
    "ScheduleZBVZeroBubble, ScheduleDualPipeV and ScheduleInterleavedZeroBubble) is not supported on a "
    "stage sharded by fullshard's fully_shard: its weight pass reads gradients of parameters() only, and "
    "fullshard's arrive in the unit's flat buffer, so they would be lost; use a schedule with a full "
    "backward (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS) or torch's "
    "fully_shard for this model"
)
_UNBOUND = (
    "a torch.distributed.pipelining stage holds a module sharded by fullshard's fully_shard, but the "
    "stage's fully_shard name is torch's, so the schedule's gradient reduction (REDUCE_GRAD) cannot reach "
    "fullshard's units: call fullshard.use_in_torch() before running the schedule (see docs/frameworks.md)"
)
# Schedules whose actions were checked (:func:`check_schedule`), not kept alive by this set.
_checked: weakref.WeakSet[Any] = weakref.WeakSet()


def _bound() -> bool:
    """Whether torch's pipeline stage module reaches fullshard's ``fully_shard.state``."""
    return getattr(getattr(sys.modules.get(STAGE_MODULE), "fully_shard", None), "state", None) is state


def _in_stage(frame: Any) -> bool:
    """Whether ``frame`` runs code of torch's pipeline stage: a function of its module (a nested
    one too) or a method of a stage, whatever module its class comes from."""
    if frame is None:
        return False
    if frame.f_globals.get("__name__") == STAGE_MODULE:
        return True
    base = getattr(sys.modules.get(STAGE_MODULE), "_PipelineStageBase", None)
    return base is not None and isinstance(frame.f_locals.get("self"), base)


def called_by_stage(frame: Any, is_last_backward: bool) -> bool:
    """Whether ``frame`` (the caller of ``FSDPModule.set_is_last_backward``) is torch's pipeline
    stage; if so, refuse what would go wrong in it.

    The stage calls ``set_is_last_backward(False)`` before every micro-batch's backward, with the
    kind of backward in its local ``backward_type``, and ``set_is_last_backward(True)`` where it
    reduces the step's gradients (REDUCE_GRAD), which every rank reaches. A split backward
    ("input", then "weight": ScheduleZBVZeroBubble, ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble) computes weight gradients only for the tensors ``parameters()``
    yields, and a fullshard unit's gradients flow into its full flat buffer instead: they would be
    lost without a word. Those schedules are refused earlier, on every rank, by
    :func:`check_schedule`; this is the check for a torch whose schedules do not unshard first.

    Args:
        frame: the caller's frame.
        is_last_backward: the value the caller passes.

    Raises:
        NotImplementedError: a split backward ("input") on a fullshard stage.
        RuntimeError: at the gradient reduction (``is_last_backward`` True), the stage's
            ``fully_shard`` is torch's: :func:`fullshard.use_in_torch` was not called. Not
            before: a rank raising in a micro-batch's backward would leave the others waiting
            for its gradients.
    """
    if not _in_stage(frame):
        return False
    if frame.f_locals.get("backward_type") == "input":
        raise NotImplementedError(_SPLIT_BACKWARD)
    if is_last_backward and not _bound():
        raise RuntimeError(_UNBOUND)
    return True


def _action_kinds(orders: list[dict]) -> set[str | None]:
    """The computation types (names) of every action in ``orders`` (rank -> actions: the
    schedule's ``pipeline_order``, and ``pipeline_order_with_comms``, which a schedule loaded
    from CSV fills alone), the sub-actions of overlapped ones (``OVERLAP_F_B``) too."""
    kinds: set[str | None] = set()
    todo = [a for order in orders for acts in order.values() for a in acts or ()]
    while todo:
        action = todo.pop()
        if action is not None:
            kinds.add(getattr(getattr(action, "computation_type", None), "name", None))
            todo.extend(getattr(action, "sub_actions", None) or ())
    return kinds


def check_schedule(frame: Any) -> None:
    """Refuse, from ``FSDPModule.unshard`` called by a torch pipeline schedule's UNSHARD action
    (``frame``: the caller's), what cannot run on fullshard's units. torch's action-list
    schedules (``pipeline_order``: Interleaved1F1B, LoopedBFS, the zero-bubble ones) unshard every
    stage before its first forward, so every rank gets here before it waits on another: raising
    here stops them all, where a refusal in one rank's backward would leave its peers waiting.
    A rank whose stage holds no fullshard module does not get here: it waits on its stopped peers
    until the process group's timeout.

    Raises:
        NotImplementedError: the schedule has weight-only backward actions (a split backward,
            see :func:`called_by_stage`).
        RuntimeError: :func:`fullshard.use_in_torch` was not called.
    """
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("fullshard.", "torch._dynamo.")):
        frame = frame.f_back  # the decorators around unshard() (dynamo's disable, once dynamo is imported)
    if frame is None or frame.f_globals.get("__name__") != SCHEDULES_MODULE:
        return
    schedule = frame.f_locals.get("self")
    found = [getattr(schedule, name, None) for name in ("pipeline_order", "pipeline_order_with_comms")]
    orders = [order for order in found if isinstance(order, dict)]
    if not orders or schedule in _checked:
        return
    if "BACKWARD_WEIGHT" in _action_kinds(orders):
        raise NotImplementedError(_SPLIT_BACKWARD)
    if not _bound():
        raise RuntimeError(_UNBOUND)
    _checked.add(schedule)
