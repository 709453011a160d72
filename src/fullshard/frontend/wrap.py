"""Wrapping: which submodules become their own FSDP units, by policy or by hand.

The call signatures are torch's (``torch.distributed.fsdp.wrap``): a policy is called as
``policy(module=m, recurse=bool, nonwrapped_numel=int)``. With ``recurse=True`` it answers
whether to look inside ``m``'s children; with ``recurse=False`` whether ``m`` itself becomes a
unit, given the number of its parameters not already in a nested unit. By hand: inside
``enable_wrap(wrapper_cls=FSDP, **kwargs)``, ``wrap(m)`` returns ``FSDP(m, **kwargs)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from torch import nn

from fullshard import compat

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` parameters not yet wrapped.

    ``force_leaf_modules`` (default: nn.MultiheadAttention) are never looked inside;
    ``exclude_wrap_modules`` (default: nn.ModuleList, nn.ModuleDict) are never wrapped
    themselves. Use through ``functools.partial(size_based_auto_wrap_policy, min_num_params=N)``.
    """
    leaf = tuple(force_leaf_modules if force_leaf_modules is not None else {nn.MultiheadAttention})
    exclude = tuple(exclude_wrap_modules if exclude_wrap_modules is not None else {nn.ModuleList, nn.ModuleDict})
    if recurse:
        return not isinstance(module, leaf)
    return nonwrapped_numel >= min_num_params and not isinstance(module, exclude)


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Iterable[type[nn.Module]],
) -> bool:
    """Wrap every instance of the classes in ``transformer_layer_cls`` (a set of classes)."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap every module for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


class ModuleWrapPolicy:
    """Wrap every instance of the given module classes.

    Args:
        module_classes: an iterable of nn.Module subclasses.

    Raises:
        TypeError: an entry that is not an nn.Module subclass.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = tuple(dict.fromkeys(module_classes))
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(
                    f"ModuleWrapPolicy takes nn.Module subclasses, got {cls!r}; "
                    "pass classes such as {{TransformerBlock}}, not instances or names"
                )
        self._classes = classes

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, self._classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self._classes]})"


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule (torch's ``always_wrap_policy``)."""
    return True


class CustomPolicy:
    """Wrap the modules ``lambda_fn`` selects, each with the root's arguments or its own
    (torch's ``CustomPolicy``).

    ``lambda_fn(module)`` returns False (or ``{}``): not a unit; True: a unit built with the
    root's arguments; a non-empty dict: a unit built with the root's arguments updated by it
    (``FullyShardedDataParallel``'s ``sharding_strategy``, ``mixed_precision``,
    ``cpu_offload``, ``backward_prefetch``, ``forward_prefetch``; another key is refused).

    Raises:
        TypeError: ``lambda_fn`` is not callable.
        ValueError: (when the policy runs) ``lambda_fn`` returned neither a bool nor a dict.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy takes a callable lambda_fn(module) -> bool | dict, got {lambda_fn!r}")
        self._lambda_fn = lambda_fn

    def _answer(self, module: nn.Module) -> bool | dict[str, Any]:
        res = self._lambda_fn(module)
        if not isinstance(res, (bool, dict)):
            raise ValueError(
                f"CustomPolicy: lambda_fn returned {res!r} for a {type(module).__name__}; "
                "return a bool or a dict of arguments"
            )
        return res

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else bool(self._answer(module))

    def overrides(self, module: nn.Module) -> dict[str, Any]:
        """The arguments ``lambda_fn`` gives ``module``'s unit beyond the root's (``{}``: none)."""
        res = self._answer(module)
        return res if isinstance(res, dict) else {}


Policy = Callable[..., bool]


def as_policy(policy: None | Policy | ModuleWrapPolicy | Iterable[Any]) -> Policy | None:
    """Normalize ``auto_wrap_policy``: a callable, a ModuleWrapPolicy, a set of classes, or
    torch's ``CustomPolicy`` (made fullshard's).

    Raises:
        TypeError: anything else.
    """
    if policy is None or callable(policy):
        return policy
    if compat.is_torch_custom_policy(policy):
        return CustomPolicy(compat.custom_policy_fn(policy))
    if isinstance(policy, (set, frozenset, list, tuple)):
        return ModuleWrapPolicy(policy)
    raise TypeError(
        f"auto_wrap_policy must be a callable policy (e.g. functools.partial("
        f"size_based_auto_wrap_policy, min_num_params=...)), a ModuleWrapPolicy, or a set of "
        f"module classes; got {type(policy).__name__}"
    )


def apply_policy(
    root: nn.Module,
    policy: Policy,
    wrap: Callable[[nn.Module], nn.Module],
    is_wrapped: Callable[[nn.Module], bool],
    ignored: AbstractSet[nn.Module],
) -> None:
    """Replace, bottom-up, the submodules of ``root`` that ``policy`` selects by ``wrap(m)``.

    ``root`` itself is never wrapped here (its caller wraps it). Already-wrapped subtrees and
    ``ignored`` modules are left alone.
    """

    def unwrapped_numel(module: nn.Module) -> int:
        total = 0
        seen: set[int] = set()
        stack = [module]
        while stack:
            m = stack.pop()
            if m in ignored or (m is not module and is_wrapped(m)):
                continue
            for p in compat.module_parameters(m).values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
            stack.extend(c for c in compat.module_children(m).values() if c is not None)
        return total

    def visit(module: nn.Module, only_children: bool) -> tuple[nn.Module, int]:
        if is_wrapped(module) or module in ignored:
            return module, 0
        numel = unwrapped_numel(module)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return module, 0
        wrapped_numel = 0
        for name, child in list(module.named_children()):
            new_child, n = visit(child, only_children=False)
            if new_child is not child:
                setattr(module, name, new_child)
            wrapped_numel += n
        remainder = numel - wrapped_numel
        if not only_children and policy(module=module, recurse=False, nonwrapped_numel=remainder):
            return wrap(module), numel
        return module, wrapped_numel

    visit(root, only_children=True)


# ---------------------------------------------------------------------------- wrapping by hand
_wrap_context: dict[str, Any] | None = None  # wrapper_cls and its kwargs while enable_wrap is active


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the context, :func:`wrap` wraps modules in ``wrapper_cls(module, **wrapper_kwargs)``.

    Lets a model's constructor mark the layers to shard (``self.l1 = wrap(nn.Linear(5, 5))``) and
    be built with or without sharding unchanged. Process-wide, like torch's.

    Args:
        wrapper_cls: the wrapper class (keyword only), e.g. ``FullyShardedDataParallel``.
        **wrapper_kwargs: constructor arguments for every wrap inside the context.

    Raises:
        TypeError: ``wrapper_cls`` is not callable.
        NotImplementedError: already inside an ``enable_wrap`` context (torch does not nest them
            either); pass per-module arguments to ``wrap`` instead.
    """
    global _wrap_context
    if not callable(wrapper_cls):
        raise TypeError(
            f"enable_wrap(wrapper_cls=...) must be a class such as FullyShardedDataParallel, got {wrapper_cls!r}"
        )
    if _wrap_context is not None:
        raise NotImplementedError(
            "enable_wrap is already active; contexts do not nest (as in torch): pass per-module arguments "
            "to wrap(module, **overrides) instead"
        )
    _wrap_context = {"wrapper_cls": wrapper_cls, "kwargs": dict(wrapper_kwargs)}
    try:
        yield
    finally:
        _wrap_context = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``wrapper_cls(module, **kwargs)`` inside :func:`enable_wrap`; ``module`` itself outside.

    Args:
        module: the module to wrap.
        **wrap_overrides: constructor arguments that take precedence over ``enable_wrap``'s for
            this module. A module's own ``_wrap_overrides`` dict (as torch honours it) takes
            precedence over both.

    Returns:
        The wrapped module inside the context, else ``module`` unchanged.

    Raises:
        TypeError: ``module`` is not an nn.Module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"wrap(module) takes an nn.Module, got {type(module).__name__}")
    if _wrap_context is None:
        return module
    kwargs = {**_wrap_context["kwargs"], **wrap_overrides, **getattr(module, "_wrap_overrides", {})}
    return _wrap_context["wrapper_cls"](module, **kwargs)
