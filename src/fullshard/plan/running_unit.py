"""Which FSDP unit runs at a given moment of a training step, and in which phase.

The meta-device trace (:mod:`fullshard.plan.peak`) labels its peak with it, and a real step
measured under :class:`~fullshard.plan.tracker.LiveTensorBytes` labels its peak the same way
(``LiveTensorBytes(label=lambda: running.moment)``), so predicted and measured moments compare
name for name. Register it on the *plain* model (before activation checkpointing and FSDP wrap
it): the hooks stay on the modules when they are wrapped, and the names are the plain model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.compat import tree_flatten

ROOT = "<root>"


def first_grad_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor in ``tree`` (args, an output tuple) that autograd will differentiate."""
    return next((t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)


def in_backward() -> bool:
    """Whether the calling thread runs inside autograd's backward (a recomputation included)."""
    return compat.in_backward()


class RunningUnit:
    """Which unit runs, by module hooks: forward pre/post hooks in forward; in backward, a
    gradient hook on a unit's output (its backward starts) and on its input (it ends), each the
    first tensor that needs a gradient. A checkpointed unit's recomputation runs inside its own
    backward and changes nothing.

    Args:
        model: the plain model (names are its ``named_modules`` names).
        is_unit: which of its modules are units; the rest of the model is :data:`ROOT`.
    """

    def __init__(self, model: nn.Module, is_unit: Callable[[nn.Module], bool]) -> None:
        self.forward: list[str] = []
        self.backward = ROOT
        for name, m in model.named_modules():
            if name and is_unit(m):
                m.register_forward_pre_hook(lambda m, args, n=name: self._enter(n, args))
                m.register_forward_hook(lambda m, args, out, n=name: self._leave(n, out))

    @property
    def name(self) -> str:
        """The unit running now ("<root>": the root's own layers, or nothing)."""
        if in_backward():
            return self.backward
        return self.forward[-1] if self.forward else ROOT

    @property
    def moment(self) -> str:
        """The phase and the unit running now, e.g. "backward of model.layers.1"."""
        return f"{'backward' if in_backward() else 'forward'} of {self.name}"

    def _set_backward(self, name: str) -> None:
        self.backward = name

    def _end_backward(self, name: str, outer: str) -> None:
        # a unit's input is often the previous unit's output, whose hook starts that unit's
        # backward: end only a unit that is still running (itself, or a unit nested in it that
        # shares its input)
        if self.backward == name or self.backward.startswith(name + "."):
            self.backward = outer

    def _enter(self, name: str, args: tuple) -> None:
        if in_backward():
            return  # recomputation
        outer = self.name
        if (first := first_grad_tensor(args)) is not None:
            first.register_hook(lambda g: self._end_backward(name, outer))
        self.forward.append(name)

    def _leave(self, name: str, out: Any) -> None:
        if in_backward():
            return
        self.forward.pop()
        if (first := first_grad_tensor(out)) is not None:
            first.register_hook(lambda g: self._set_backward(name))
