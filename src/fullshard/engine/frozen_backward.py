"""Units with no trainable parameter: their post-backward, which no gradient hook can start.

The engine starts a unit's post-backward (reshard, reduce-scatter) from the hook on its full flat
gradient; a unit whose parameters are all frozen has none, and stayed gathered to the end of
backward. Its forward inputs go through an identity whose backward, run once the unit's backward
has made those inputs' gradients, reshards it instead (torch's FSDP does the same). The counts
of calls still to finish live in :class:`~fullshard.engine.hooks.RootState` (``frozen_pending``),
cleared by :func:`~fullshard.engine.hooks.finish_backward`.
"""

from __future__ import annotations

from typing import Any

import torch

from fullshard import compat
from fullshard.engine import hooks
from fullshard.engine.dynamo_guard import outside_dynamo
from fullshard.engine.hooks import FSDPState
from fullshard.engine.unit import TrainingState


class _FrozenUnitInputs(torch.autograd.Function):
    """Identity on the forward inputs of a unit with no trainable parameter. Such a unit has no
    flat gradient to hook, so no post-backward; this function's backward runs once the unit's
    backward has made its inputs' gradients, and stands in for it (:func:`_frozen_post_backward`)."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @outside_dynamo  # autograd calls it: from a compiled step's backward too, never to be traced
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _frozen_post_backward(ctx.state)
        return (None, *grads)


def hook_frozen_inputs(state: FSDPState, inputs: Any) -> Any:
    """For a unit with no trainable parameter, in a forward with grad (not a recomputation):
    route the input tensors that require grad through :class:`_FrozenUnitInputs`, so that the
    unit reshards when its backward is done (as torch's FSDP does) instead of staying gathered
    to the end of backward. A frozen block between trainable ones (a tied embedding below the
    frozen lower layers of a fine-tuned model) runs backward for its input gradients alone.
    Returns ``inputs``, those tensors replaced; unchanged for any other unit."""
    unit, root = state.unit, state.root
    if unit.trainable or root is None or not torch.is_grad_enabled():
        return inputs
    if unit.training_state is not TrainingState.FORWARD:
        return inputs
    tensors = [t for t in compat.tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return inputs
    routed = dict(zip(map(id, tensors), _FrozenUnitInputs.apply(state, *tensors)))
    root.frozen_pending[id(unit)] = root.frozen_pending.get(id(unit), 0) + 1
    return compat.tree_map(lambda t: routed.get(id(t), t) if isinstance(t, torch.Tensor) else t, inputs)


@outside_dynamo
def _frozen_post_backward(state: FSDPState) -> None:
    """A frozen unit's backward reached the inputs of one of its forward calls; after the last
    of them, reshard it as :func:`~fullshard.engine.hooks.post_backward` would (there is nothing to reduce)."""
    unit, root = state.unit, state.root
    assert root is not None
    left = root.frozen_pending.get(id(unit), 0) - 1
    if left > 0:
        root.frozen_pending[id(unit)] = left
        return
    root.frozen_pending.pop(id(unit), None)
    if unit.training_state is not TrainingState.PRE_BACKWARD:
        return
    unit.training_state = TrainingState.POST_BACKWARD
    hooks.end_backward(unit, root)
