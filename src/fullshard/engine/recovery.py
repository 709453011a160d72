"""Recovery from an iteration that an exception aborted in forward or backward.

An exception raised inside a unit's forward (or by a hook, or by the model, during backward)
leaves the tree mid-iteration: units gathered or in FORWARD / PRE_BACKWARD, an all-gather
prefetched and never waited on, reduce-scatters in flight, gradients accumulated with sync off
and HSDP partial sums that belong to the micro-batches of the lost step. Both front ends tidy
up on their own, so that after ``zero_grad`` the next step is the unsharded model's: a backward
that raised does as it leaves (the reductions launched land in ``.grad``, as autograd's
accumulation had on an unsharded model, and the gradients not yet reduced are dropped); a
forward that raised, at the root's next forward (every unit reshards before it gathers again).
:func:`reset_iteration`, which ``FSDPModule.reset_iter_state`` calls (torch's FSDP2 API for
this), does it at once and discards even the reductions in flight, as torch's does: the failed
iteration is lost, and gradient accumulation starts again with the next micro-batch.
"""

from __future__ import annotations

from fullshard.comm import buffers, exposed_comm
from fullshard.engine.hooks import RootState
from fullshard.engine.unit import TrainingState


def reset_iteration(root: RootState) -> None:
    """Bring every unit of ``root``'s tree back to SHARDED and IDLE with no gradient in flight.

    Waits for every collective in flight (the other ranks' parts of it arrive: all ranks must
    call this, as they all raised), drops every gradient not yet in a shard's ``.grad`` (see
    :meth:`~fullshard.engine.reduce.GradReducer.discard`), frees the full parameters, and clears
    what the iteration recorded (the units whose backward ran, the unit kept gathered for
    backward, open passes over several-module units). The shards' ``.grad`` set before the
    exception stay: ``zero_grad`` drops them. Settings (gradient sync, resharding, prefetch
    lists) and the last forward order (for prefetching) stay too.
    """
    for unit in root.units:
        unit.grads.discard()
    held, root.held_without_grad = root.held_without_grad, None
    for unit in [*root.units, *(held or ())]:
        unit.reshard()  # waits for a prefetched all-gather first
        exposed_comm.close_range(unit.backward_range)
        unit.backward_range = None
        unit.training_state = TrainingState.IDLE
    for state in root.states:
        exposed_comm.close_range(state.forward_range)
        state.forward_range = None
        state.modules_to_run.clear()
        state.methods_running = 0
    buffers.POOL.clear(keep_cpu=True)
    root.forward_order = []
    root.forward_without_grad.clear()
    root.grad_pass = False
    root.kept = root.last_reduced = None
    root.turns = None  # the reduction turns of the backward it abandoned (reduce_order)
    root.callback_queued = False
    root.forget_backward()
