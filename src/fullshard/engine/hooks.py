"""Hooks: when units gather, free and reduce, driven by forward and autograd.

- pre-forward: all-gather the unit (waiting on a prefetch if one is in flight), put the full
  parameters in place, and with ``forward_prefetch`` start the next unit's all-gather.
- post-forward: put the shards back; free the full parameters under FULL_SHARD, or when no
  backward can follow (a unit that keeps them after forward: when the root's forward ends, so
  a second call in it gathers nothing); hook the outputs so the unit knows when its backward
  begins. Inside a method registered with ``register_fsdp_forward_method`` a forward's end is
  not the pass's end: the method's is.
- pre-backward (a hook on the unit's outputs): all-gather again if freed; with BACKWARD_PRE
  start the all-gather of the unit that runs next in backward (the previous one in forward).
- post-backward (the unit's post-accumulate-grad hook; in a nested backward it may wait:
  :mod:`.nested_grad`): launch the gradient reduce-scatter, free the full parameters; with
  BACKWARD_POST start the next all-gather here instead.
- a callback queued on the autograd engine at the first pre-backward: wait for the reductions,
  free what is left, and bring every unit back to IDLE.

Hooks call units only; they never touch torch.distributed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from fullshard import compat, probes
from fullshard.comm import buffers, exposed_comm, flight_recorder
from fullshard.engine import backward_buffers, dynamo_guard, gather_reuse, reduce_order, reshard_guard, shard_sync
from fullshard.engine.config import BackwardPrefetch, FrontEnd
from fullshard.engine.dynamo_guard import outside_dynamo
from fullshard.engine.hook_state import FSDPState, RootState, backward_neighbour, neighbour
from fullshard.engine.module_wrapper import clean_name
from fullshard.engine.nested_grad import enter_backward, enter_forward, flush_deferred, grad_ready, holds, note_awaited
from fullshard.engine.unit import ShardState, TrainingState, Unit
from fullshard.engine.unit_check import check_same_units
from fullshard.engine.unreached_reshard import defers_reshard, regather_for_backward

_STATE_ATTR = "_fsdp_state"


def fsdp_state(module: nn.Module) -> FSDPState | None:
    """The FSDP state of ``module`` when it heads a unit (either front end), else None.

    The one accessor for it: the state lives in the module's ``__dict__`` under one private
    attribute, so ``nn.Module.__getattr__`` and user attributes never see or shadow it.
    """
    return module.__dict__.get(_STATE_ATTR)


def set_fsdp_state(module: nn.Module, state: FSDPState) -> None:
    """Make ``module`` head the unit whose FSDP state is ``state``."""
    module.__dict__[_STATE_ATTR] = state


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` heads an FSDP unit (a wrapper, or a module given to fully_shard).

    Args:
        module: any module.

    Returns:
        True for a ``FullyShardedDataParallel`` wrapper or a module ``fully_shard`` was applied to.
    """
    return _STATE_ATTR in module.__dict__


def unit_count(model: nn.Module) -> int:
    """The number of FSDP units in ``model``'s tree (either front end; ``model`` itself included).

    Args:
        model: any module, sharded or not (0 when nothing in it is).

    Returns:
        how many distinct units head a module of ``model.modules()``.
    """
    return len({id(state.unit) for m in model.modules() if (state := fsdp_state(m)) is not None})


def lazy_init(module: nn.Module) -> FSDPState:
    """At the first forward, make ``module`` the root of every unit in its tree (once).

    Names each unit after its module, shares one RootState, and connects the units'
    gradient-ready hooks. Returns ``module``'s FSDP state.
    """
    state = fsdp_state(module)
    assert state is not None, "lazy_init on a module that heads no unit"
    if state.root is not None:
        return state
    members: dict[int, tuple[str, FSDPState]] = {}  # one entry per unit (fully_shard of a list shares one)
    for n, m in module.named_modules():
        if (h := fsdp_state(m)) is not None:
            members.setdefault(id(h), (clean_name(n) or "<root>", h))
    members_list = list(members.values())
    root = RootState(
        [h.unit for _, h in members_list], [h for _, h in members_list], state.backward_prefetch, state.forward_prefetch
    )
    for name, h in members_list:
        if h.root is not None:  # a unit's unshard() by hand before the first forward made it a root
            root.gathered_by_hand.update(h.root.gathered_by_hand)
        h.unit.name = name
        h.is_root = h is state
        h.root = root
        h.unit.on_grad_ready = lambda u, r=root: grad_ready(u, r, post_backward)
        h.unit.on_relayout = lambda r=root: backward_buffers.mark_sole_sizes(r.units)
    backward_buffers.mark_sole_sizes(root.units)
    return state


def prefetch(unit: Unit | None) -> None:
    if unit is not None and unit.shard_state is ShardState.SHARDED:
        with flight_recorder.at(phase="backward prefetch" if _in_backward() else "forward prefetch"):
            unit.unshard(async_op=True)


def prepare_inputs(state: FSDPState, inputs: Any) -> Any:
    """The root moves forward inputs to the compute device; mixed precision casts them.

    Floating-point tensors are cast to ``param_dtype`` at the root when
    ``cast_root_forward_inputs``, and at every unit when ``cast_forward_inputs``.
    """
    device = state.unit.device
    mp = state.mixed_precision
    dtype = None
    if mp is not None and mp.param_dtype is not None:
        if mp.cast_forward_inputs or (state.is_root and mp.cast_root_forward_inputs):
            dtype = mp.param_dtype
    move = state.is_root and device.type != "cpu"
    if dtype is None and not move:
        return inputs

    def convert(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if move:
            t = t.to(device)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t

    return compat.tree_map(convert, inputs)


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return compat.in_backward()


def _left_behind(unit: Unit, by_hand: dict[int, int]) -> bool:
    """Whether the last iteration left ``unit`` gathered, busy or reducing. One gathered by
    ``FSDPModule.unshard`` for this forward (``by_hand``: its shards' version then) is not,
    unless an optimizer step has changed its shards since: its forward then gathers afresh. Nor
    is one an earlier forward left gathered whose backward is still to come, while its shards are
    unchanged since that gather (:mod:`~fullshard.engine.gather_reuse`): the
    micro-batches of a pipeline schedule's step use one all-gather, as torch's do."""
    if unit.training_state is not TrainingState.IDLE or unit.has_pending_reduce:
        return True
    version = by_hand.get(id(unit))
    if version is not None and version == shard_sync.shards_version(unit):
        return False
    if unit.has_pending_gather:
        return True
    if unit.shard_state is ShardState.SHARDED or not unit.reshard_after_backward:
        return False
    if gather_reuse.reusable_gathered(unit):
        return False
    gather_reuse.note_kept_gathered(unit)
    return True


def root_pre_forward(state: FSDPState) -> None:
    """Start of an iteration at the root: tidy up what the last iteration left behind.

    A forward with grad enabled and no backward leaves units gathered (the next forward would
    use stale parameters after an optimizer step); a backward that raised leaves its callback
    unrun. Outside a backward, finish both so every unit starts SHARDED and IDLE.
    """
    root = state.root
    assert root is not None
    if _in_backward():
        return  # a recomputation (activation checkpointing of the root)
    reduce_order.root_forward(root)
    by_hand, root.gathered_by_hand = root.gathered_by_hand, {}
    left = [_left_behind(u, by_hand) for u in root.units]  # each unit's: it may start recording versions
    if root.callback_queued or any(left):
        finish_backward(root)
    if root.post_optim_event is not None:  # a torch.cuda.Event has no device; on the CPU: nothing to wait for
        kind = getattr(root.post_optim_event, "device", None)
        kind = "cuda" if kind is None else torch.device(kind).type
        if kind != "cpu":
            torch.get_device_module(kind).current_stream().wait_event(root.post_optim_event)
        root.post_optim_event = None
    _reshard_held(root)  # left by a forward without grad that raised
    root.held_without_grad = None if torch.is_grad_enabled() else []
    for h in root.states:  # a pass left open by the last iteration (a chunked loss's head)
        if h is not state:  # the root's own pass has just begun
            h.modules_to_run.clear()
    if not root.units_checked:
        root.units_checked = True
        check_same_units(root.units)
    root.grad_pass = torch.is_grad_enabled()
    if root.grad_pass:
        flight_recorder.root_forward()
        if root.forward_order:
            root.last_forward_order = root.forward_order
        root.forward_order = []
        root.forward_without_grad.clear()


def pre_forward(state: FSDPState) -> None:
    unit, root = state.unit, state.root
    assert root is not None
    if state.is_root:
        root_pre_forward(state)
    enter_forward(unit, root)
    unit._check_state((TrainingState.IDLE, TrainingState.PRE_BACKWARD), "run forward")
    if root.kept is not None and not state.is_root:
        _release_kept(root, unit)
    if unit.training_state is TrainingState.IDLE:
        unit.training_state = TrainingState.FORWARD
    exposed_comm.close_range(state.forward_range)  # a member of a several-module unit run again
    state.forward_range = exposed_comm.open_range(f"fullshard::unit forward {unit.name}")
    unit.unshard()
    unit.install_full_params()
    if probes.ACTIVE is not None:
        probes.record_event("forward", unit.name)
    in_backward = _in_backward()
    if not in_backward and unit not in root.forward_order and (torch.is_grad_enabled() or root.grad_pass):
        root.forward_order.append(unit)
        if not torch.is_grad_enabled():  # reentrant activation checkpointing's forward
            root.forward_without_grad.add(id(unit))
    elif not in_backward and torch.is_grad_enabled():  # run again, with grad this time
        root.forward_without_grad.discard(id(unit))
    if unit.training_state is TrainingState.FORWARD and not in_backward:  # not in a recomputation
        if state.prefetch_in_forward is not None:
            for other in state.prefetch_in_forward:
                prefetch(other)
        elif root.forward_prefetch:
            prefetch(neighbour(root.last_forward_order, unit, +1))


def post_forward(state: FSDPState, output: Any) -> Any:
    unit, root = state.unit, state.root
    assert root is not None
    if probes.ACTIVE is not None:
        probes.record_event("forward_end", unit.name)
    exposed_comm.close_range(state.forward_range)
    state.forward_range = None
    grad = torch.is_grad_enabled()
    in_recompute = unit.training_state is not TrainingState.FORWARD
    # A forward inside backward with grad (reentrant activation checkpointing's recomputation:
    # its own backward follows at once) keeps the unit gathered for it, as torch's does.
    root_kept = root_keeps(state)
    keeps = root_kept or (grad and not in_recompute and _in_backward())
    if not (grad and not in_recompute and root_kept):
        # The root stays gathered into backward with its full parameters in place, as torch's
        # does: a loss that reads them after forward (a tied output projection) gets the full
        # tensors, their gradients flowing into the unit's. Its reshard takes them out.
        unit.uninstall_full_params()
    if not in_recompute:
        unit.training_state = TrainingState.IDLE
        # Without grad inside a root forward with grad (reentrant checkpointing's first pass, its
        # backward to come with the recomputation): reshard as with grad, so that ranks that
        # checkpoint the unit and ranks that do not issue the same all-gathers in backward.
        passes = grad or root.grad_pass
        if passes and unit.reshard_after_forward and not keeps and unit.post_forward_shard is not None:
            unit.reshard_post_forward()  # reshard_after_forward=M: 1/M kept for backward's smaller gather
        elif not passes and not unit.reshard_after_forward and not keeps and root.held_without_grad is not None:
            if unit not in root.held_without_grad:
                root.held_without_grad.append(unit)
        elif not passes or (unit.reshard_after_forward and not keeps and not keeps_last_gathered(state)):
            unit.reshard()
        elif unit.reshard_after_forward and not keeps:
            root.kept = unit
        if state.is_root:
            _reshard_held(root)
            root.grad_pass = False
    if grad and not in_recompute:
        register_pre_backward(state, output)
        if state.is_root:
            output = _complete_unfinished_passes(root, state, output)
    return output


def root_keeps(state: FSDPState) -> bool:
    """Whether ``state``'s unit keeps its full parameters from forward into backward because it
    is the root: always for the wrapper's root (as torch's FSDP1), and for ``fully_shard``'s
    unless ``reshard_after_forward`` was given explicitly or set since (torch >= 2.8's rule)."""
    return state.is_root and (state.front_end is FrontEnd.WRAPPER or state.unit.auto_reshard_after_forward)


# Whether the wrapper keeps the last unit gathered after forward (:func:`keeps_last_gathered`);
# a switch for measuring the rule (tools/interleave.py), not an option.
KEEP_LAST_GATHERED = True
# Whether the root's pre-backward prefetches the last unit of forward (:func:`backward_neighbour`
# with ``first``); a switch for measuring the rule (tools/interleave.py), not an option.
ROOT_BACKWARD_PREFETCH = True


def _release_kept(root: RootState, unit: Unit) -> None:
    """Another unit's forward or backward began while ``root.kept`` is still gathered (or being
    gathered: the root's backward prefetched it): this step's order is not the last one's (the
    kept unit ran early, or its output does not reach the loss), so keeping it would raise the
    peak. Reshard it, as its post-forward would have; its backward, if one comes, gathers it
    again."""
    kept, root.kept = root.kept, None
    if kept is not None and kept is not unit and (kept.shard_state is ShardState.UNSHARDED or kept.has_pending_gather):
        kept.reshard()  # waits for a prefetched all-gather first


def _reshard_held(root: RootState) -> None:
    """Reshard the units a root forward without grad kept gathered (``root.held_without_grad``):
    no backward follows, and the next forward must not read them after an optimizer step."""
    held, root.held_without_grad = root.held_without_grad, None
    for unit in held or ():
        unit.reshard()


def keeps_last_gathered(state: FSDPState) -> bool:
    """Whether ``state``'s unit, a FULL_SHARD unit of the wrapper that is not the root (the
    caller, :func:`post_forward`, checks the strategy and the root), stays gathered after
    forward because backward will gather it first anyway: it ran last in the previous step's forward,
    and with ``BACKWARD_PRE`` the root's pre-backward would prefetch it at once (torchtitan
    sets ``reshard_after_forward=False`` on its last block by hand for the same reason). One
    all-gather fewer per step and no higher peak: the unit would be gathered again as backward
    starts, with the activations at their largest. ``fully_shard`` units keep what the user
    asked for, as in torch. The planner's replay does the same
    (:func:`fullshard.plan.schedule.replay`, ``keep_last``)."""
    root = state.root
    assert root is not None
    return (
        KEEP_LAST_GATHERED
        and state.front_end is FrontEnd.WRAPPER
        and root.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
        and bool(root.last_forward_order)
        and root.last_forward_order[-1] is state.unit
    )


def _complete_unfinished_passes(root: RootState, state: FSDPState, output: Any) -> Any:
    """At the end of the root's forward, finish each several-module unit whose members did not
    all run (torchtitan's chunked loss: the model's forward stops at the norm of a
    ``[norm, output]`` unit and the loss runs the head later): reshard it as its own post-forward
    would, and hook the root's outputs so backward gathers it again before it reads its
    parameters."""
    for other in root.states:
        if other is not state and other.modules_to_run:
            other.modules_to_run.clear()
            output = post_forward(other, output)
    return output


def register_pre_backward(state: FSDPState, output: Any) -> Any:
    """Hook every tensor of ``output`` that requires grad, so that the unit is gathered (and
    its prefetches start) when backward reaches it. Returns ``output``."""
    tensors, _ = compat.tree_flatten(output)
    call: list[bool] = []  # this call's hooks share it: whether one of them has run
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(functools.partial(_pre_backward, state, call))
            if state.root is not None:
                state.root.backward_units.add(id(state.unit))
    return output


@outside_dynamo
def _pre_backward(state: FSDPState, call: list[bool], grad: torch.Tensor) -> torch.Tensor:
    unit, root = state.unit, state.root
    assert root is not None
    traced = dynamo_guard.compiled_autograd_error(unit.name)
    if traced is not None:
        raise traced
    if not root.callback_queued:
        root.callback_queued = True
        compat.queue_backward_callback(functools.partial(_backward_done, root))
        reshard_guard.if_backward_fails(functools.partial(_backward_failed, root))
        regather_for_backward(root)
        note_awaited(root.units)
    enter_backward(unit, root, call)
    if id(unit) in root.pre_backward_done:
        return grad
    root.pre_backward_done.add(id(unit))
    if root.kept is not None and not state.is_root:
        _release_kept(root, unit)
    if probes.ACTIVE is not None:
        probes.record_event("backward", unit.name)
    unit.training_state = TrainingState.PRE_BACKWARD
    unit.grads.drop_if_zeroed()  # a zero_grad since the backward with sync off
    unit.backward_range = exposed_comm.open_range(f"fullshard::unit backward {unit.name}")
    unit.unshard()
    unit.install_full_params(for_recompute=True)  # activation checkpointing may recompute forward on them
    if state.prefetch_in_backward is not None:
        for other in state.prefetch_in_backward:
            prefetch(other)
    elif root.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        first = state.is_root and ROOT_BACKWARD_PREFETCH
        target = backward_neighbour(root, unit, first=first)
        prefetch(target)
        if first and root.kept is None and target is not None and id(target) not in root.pre_backward_done:
            # Released, as a kept unit is, if another unit's backward comes first. Not one whose
            # backward has begun (its hook on the same output ran before the root's): its own
            # post-backward decides, and with set_reshard_after_backward(False) keeps it.
            root.kept = target
    return grad


@outside_dynamo
def post_backward(unit: Unit, root: RootState) -> None:
    """Called when ``unit``'s full flat gradient has been accumulated."""
    unit.training_state = TrainingState.POST_BACKWARD
    if unit.sync_grads:
        reduce_order.reached(unit, root)  # now, or at its turn under reduce_unreached
    else:
        unit.grads.hold_unsynced()
    end_backward(unit, root)


def end_backward(unit: Unit, root: RootState) -> None:
    """The end of ``unit``'s post-backward (also a frozen unit's, :mod:`.frozen_backward`): reshard (not
    in a backward that creates a graph, :func:`_backward_done`, nor a flagged unit, :mod:`.unreached_reshard`),
    free buffers done with, close its range, ``BACKWARD_POST``'s prefetch."""
    if unit.reshard_after_backward and not torch.is_grad_enabled() and not (defers_reshard(unit) or holds(unit, root)):
        unit.reshard()
        backward_buffers.drop_done_with(unit, root.forward_order, root.expected_backward())
    exposed_comm.close_range(unit.backward_range)
    unit.backward_range = None
    if root.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        prefetch(backward_neighbour(root, unit))


@outside_dynamo
def _backward_done(root: RootState) -> None:
    """The backward's final callback: reduce what units accumulated while sync was off and this
    backward did not reach (their sums would wait for their next backward), and zeros for the
    units it did not reach under ``reduce_unreached``, in the order of :mod:`.reduce_order`;
    agree across ranks on which unused parameters keep ``.grad`` None
    (:func:`.reduce_order.settle_unused`); then finish. A backward that creates a graph
    (``create_graph=True``: grad mode is on in its callback and post-backward hooks) leaves its
    units gathered, frozen ones too: the graph it made (a gradient penalty's) saved their full
    parameters for the next backward, whose end, or the next forward, reshards them. It leaves
    the sums held from micro-batches with sync off to that backward too (reduced once, not
    twice), but for units with ``reduce_unreached``, which every rank reduces in every backward."""
    graph = torch.is_grad_enabled()
    flush_deferred(root, post_backward)
    turns_taken = reduce_order.launch_rest(root, graph)
    for unit in root.units:
        if turns_taken or graph or not unit.sync_grads or unit.has_pending_reduce:
            continue
        if unit.grads.reduce_unreached and unit.training_state is not TrainingState.POST_BACKWARD:
            unit.grads.fill_zeros()
        if unit.grads.holds_unreduced:
            unit.reduce_grads()
    reduce_order.settle_unused(root)
    finish_backward(root, reshard=not graph)


def _backward_failed(root: RootState) -> None:
    """The backward that queued :func:`_backward_done` raised, so autograd dropped that callback.
    As an unsharded model keeps what autograd accumulated into ``.grad`` before the error, the
    reductions launched land in the shards' ``.grad``; the gradients not yet reduced (and those
    accumulated with sync off before) are dropped, and every unit is back to IDLE: after
    ``zero_grad`` the next step is the unsharded model's."""
    if root.callback_queued:  # else that backward finished and a later one raised
        finish_backward(root)
        for unit in root.units:
            unit.grads.discard()


@outside_dynamo
def finish_backward(root: RootState, reshard: bool = True) -> None:
    """End of backward: wait for every reduction, free every unit (not with ``reshard=False``),
    all back to IDLE."""
    for unit in root.units:
        unit.finish_reduce()
    if any(u.config.offload for u in root.units):
        # Offloaded gradients arrive by non-blocking copies to pinned memory, and shards left by
        # them: the CPU optimizer may touch neither before those copies are done.
        torch.cuda.current_stream().synchronize()
    for unit in root.units:
        if unit.reshard_after_backward and reshard:
            unit.reshard()
        exposed_comm.close_range(unit.backward_range)  # a unit whose parameters got no gradient
        unit.backward_range = None
        unit.training_state = TrainingState.IDLE
    buffers.POOL.clear(keep_cpu=True)  # CPU memory is kept for the next step; CUDA's allocator caches its own
    root.last_reduced = None
    root.turns = None
    root.kept = None
    root.callback_queued = False
    if root.pre_backward_done:
        root.last_backward = set(root.pre_backward_done)
    root.forget_backward()
