"""The autograd function between a unit's full flat buffer and its trainable parameters.

Forward hands out views of the full flat buffer, one per trainable parameter; backward packs
their gradients rank-major in one copy, the reduce-scatter's input as it stands. Each unit
applies a subclass named after it (:func:`named_split`), so autograd's errors about the views
(a use after reshard) name the unit.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fullshard.engine import reshard_guard
from fullshard.engine.dynamo_guard import outside_dynamo
from fullshard.engine.layout import real_views

__all__ = ["CHILD_GRAD", "SplitFull", "named_split"]

# The units whose gradient, in the nested backward running now (a reentrant checkpoint's), came
# from the full parameters their pre-backward hook installed for a recomputation (untracked
# nodes): a child segment's recomputation, not the unit's own forward (see :mod:`.nested_grad`).
CHILD_GRAD: weakref.WeakSet[Any] = weakref.WeakSet()


class _SplitUnit(Protocol):
    """What :class:`SplitFull` reads of a :class:`~.unit.Unit`."""

    name: str
    trainable: list[Any]
    grads: Any
    _full_splits: list[list[int]]
    _open_splits: weakref.WeakSet[Any]

    def reshard_for_packing(self) -> None: ...

    def pack_grads(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor: ...


class SplitFull(torch.autograd.Function):
    """Split a unit's full flat buffer into its trainable parameters; gradients come back packed.

    Forward: ``flat`` (the trainable prefix of the param-major full flat buffer, shape
    ``(N*S_t,)``) to views, one per trainable parameter, shapes ``orig_shape`` (no copy);
    ``tracked``: the unit counts the node among those whose backward may still run. Backward:
    one copy of the parameters' gradients into a rank-major buffer (:meth:`Unit.pack_grads`),
    which becomes the flat buffer's ``.grad``; autograd's own split would concatenate
    param-major and need a second copy before the reduce-scatter.

    Raises (backward):
        RuntimeError: the node's forward ran before the unit was laid out again for a
            ``requires_grad`` change (:func:`~.reshard_guard.stale_error`).
    """

    _unit_name = ""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, unit: _SplitUnit, tracked: bool) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit, ctx.tracked = unit, tracked
        ctx.set_materialize_grads(False)
        if tracked:
            unit._open_splits.add(ctx)
        return tuple(real_views(flat, unit._full_splits[0], [sp.spec.orig_shape for sp in unit.trainable]))

    @staticmethod
    @outside_dynamo  # autograd calls it: from a compiled step's backward too, never to be traced
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        unit: _SplitUnit = ctx.unit
        if getattr(ctx, "stale", False):
            raise reshard_guard.stale_error(unit.name)
        again = getattr(ctx, "ran", False)  # a retained graph's later backward: other nodes may read the views yet
        ctx.ran, ctx.awaited = True, False
        unit._open_splits.discard(ctx)
        if all(g is None for g in grads):
            return None, None, None
        child = not ctx.tracked and reshard_guard.nested_backward()  # another segment may recompute yet
        if child:
            CHILD_GRAD.add(unit)
        unit.grads.note_used(grads)
        # No later backward reads the full parameters. Not a flagged unit (some ranks only get
        # here) in a backward that creates a graph: its end reshards nothing (unreached_reshard).
        if not (again or child or unit._open_splits or (unit.grads.reduce_unreached and torch.is_grad_enabled())):
            unit.reshard_for_packing()
        return unit.pack_grads(grads), None, None


def named_split(name: str) -> type[SplitFull]:
    """:class:`SplitFull` under the name ``FullParametersOfFSDPUnit[<name>]`` (unit ``name``)."""
    return type(f"FullParametersOfFSDPUnit[{name}]", (SplitFull,), {"_unit_name": name})
