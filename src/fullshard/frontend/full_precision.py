"""Modules the FSDP1 wrapper keeps in full precision under mixed precision (torch FSDP1's
``MixedPrecision._module_classes_to_ignore``, BatchNorm by default).

When ``FullyShardedDataParallel`` gets both an ``auto_wrap_policy`` and mixed precision, every
submodule of those classes becomes a unit of its own whose mixed precision is off: its
parameters are gathered and its gradients reduced in their own dtype, and its buffers are not
cast. Each such module (and each ignored module of those classes, as torch's) gets two forward
hooks, registered after any it has: the pre-hook casts its floating-point positional inputs to
float32, the post-hook casts its floating-point outputs back to the dtype those inputs had, so
the modules around it keep computing in the low-precision dtype. Without an ``auto_wrap_policy``
nothing here runs, as in torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.engine.config import MixedPrecision
from fullshard.engine.hooks import is_unit

Policy = Callable[..., bool]


def prepare(root: nn.Module, mp: MixedPrecision | None) -> tuple[type[nn.Module], ...]:
    """Hook the submodules of ``root`` of ``mp._module_classes_to_ignore``; warn naming their classes.

    Called once, by the outermost wrapper, before its policy wraps anything. ``root`` itself
    is left as it is (it is the wrapper's own module, under the wrapper's mixed precision), and
    so are the subtrees of units built before (their own wrappers' settings hold there).

    Args:
        root: the module the outermost wrapper wraps.
        mp: its mixed precision (None: none).

    Returns:
        the classes whose instances become full-precision units (empty: nothing changes).
    """
    if mp is None or not mp._module_classes_to_ignore:
        return ()
    classes = tuple(mp._module_classes_to_ignore)
    found = list(_instances(root, classes))
    for module in found:
        register_casts(module)
    if found:
        names = ", ".join(sorted({type(m).__name__ for m in found}))
        warnings.warn(
            f"FullyShardedDataParallel: mixed precision with an auto_wrap_policy: the submodules of class "
            f"{names} (MixedPrecision._module_classes_to_ignore) become units of their own with mixed "
            "precision disabled, computing in float32 (their inputs cast up, their outputs back), as torch's "
            "FSDP1 does; pass MixedPrecision(..., _module_classes_to_ignore=()) to apply mixed precision to them too",
            UserWarning,
            stacklevel=4,
        )
    return classes


def with_classes(policy: Policy, classes: tuple[type[nn.Module], ...]) -> Policy:
    """``policy``, also wrapping every instance of ``classes`` (and so looking inside every module).

    As torch FSDP1 combines them: the user's policy is asked first, and either answer counts.
    """
    if not classes:
        return policy

    def either(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel):
            return True
        return recurse or isinstance(module, classes)

    return either


def _instances(root: nn.Module, classes: tuple[type[nn.Module], ...]) -> Iterator[nn.Module]:
    """The modules of ``classes`` under ``root`` (not ``root``), outside units built before."""
    for child in compat.module_children(root).values():
        if child is None or is_unit(child):
            continue
        if isinstance(child, classes):
            yield child
        yield from _instances(child, classes)


def register_casts(module: nn.Module) -> None:
    """Run ``module`` in float32 between modules computing in another dtype (see the module docstring)."""
    input_dtype: dict[str, torch.dtype] = {}  # the dtype of the last call's cast inputs, if any

    def up(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        cast: list[torch.dtype] = []

        def to_float32(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32:
                cast.append(t.dtype)
                return t.to(torch.float32)
            return t

        args = compat.tree_map(to_float32, args)
        if not cast:
            input_dtype.pop("dtype", None)
            return None
        input_dtype["dtype"] = cast[-1]
        return args

    def down(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        dtype = input_dtype.get("dtype")
        if dtype is None:
            return None

        def back(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                return t.to(dtype)
            return t

        return compat.tree_map(back, output)

    module.register_forward_pre_hook(up)
    module.register_forward_hook(down)
