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

from typing import Any

from torch import nn

from fullshard import compat
from fullshard.engine import hooks
from fullshard.engine.unit import Unit

# The module of torch's whose ``fully_shard`` name must be fullshard's for REDUCE_GRAD to work.
STAGE_MODULE = "torch.distributed.pipelining.stage"


class UnitReduction:
    """One unit, as the stage sees one of torch's parameter groups."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    def post_backward(self) -> None:
        """Launch the reduction of what the unit accumulated while gradient sync was off (none
        when sync is still off, one is in flight, or nothing was accumulated)."""
        unit = self.unit
        if unit.sync_grads and not unit.has_pending_reduce and unit.grads.holds_unreduced:
            unit.reduce_grads()


class UnitState:
    """One unit's FSDP state, as the stage sees torch's: ``_fsdp_param_groups`` is its unit."""

    def __init__(self, unit: Unit) -> None:
        self._fsdp_param_groups = [UnitReduction(unit)]


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
                group.post_backward()
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


def called_by_stage(frame: Any) -> bool:
    """Whether ``frame`` (the caller of an ``FSDPModule`` setter) is torch's pipeline stage
    preparing a micro-batch's backward; if so, refuse what would go wrong in it.

    The stage calls ``set_is_last_backward(False)`` before every micro-batch's backward, with the
    kind of backward in its local ``backward_type``. A split backward ("input", then "weight":
    ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleInterleavedZeroBubble) computes weight
    gradients only for the tensors ``parameters()`` yields, and a fullshard unit's gradients
    flow into its full flat buffer instead: they would be lost without a word.

    Raises:
        NotImplementedError: a split backward ("input") on a fullshard stage.
        RuntimeError: the stage's ``fully_shard`` is torch's (REDUCE_GRAD would fail at the end
            of the step): :func:`fullshard.use_in_torch` was not called.
    """
    if frame is None or frame.f_globals.get("__name__") != STAGE_MODULE:
        return False
    if frame.f_locals.get("backward_type") == "input":
        raise NotImplementedError(
            "torch.distributed.pipelining's split backward (backward_input / backward_weight, used by "
            "ScheduleZBVZeroBubble, ScheduleDualPipeV and ScheduleInterleavedZeroBubble) is not supported on a "
            "stage sharded by fullshard's fully_shard: its weight pass reads gradients of parameters() only, and "
            "fullshard's arrive in the unit's flat buffer, so they would be lost; use a schedule with a full "
            "backward (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS) or torch's "
            "fully_shard for this model"
        )
    bound = getattr(frame.f_globals.get("fully_shard"), "state", None)
    if bound is not state:
        raise RuntimeError(
            "a torch.distributed.pipelining stage holds a module sharded by fullshard's fully_shard, but the "
            "stage's fully_shard name is torch's, so the schedule's gradient reduction (REDUCE_GRAD) cannot reach "
            "fullshard's units: call fullshard.use_in_torch() before running the schedule (see docs/frameworks.md)"
        )
    return True
