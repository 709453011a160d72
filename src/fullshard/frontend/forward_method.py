"""``register_fsdp_forward_method``: a method other than ``forward`` (``generate``) that gathers
and frees a ``fully_shard`` unit's parameters as ``forward`` does, by running the module's own
forward hooks around it."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from fullshard import compat
from fullshard.engine import hooks


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and free parameters as ``forward`` does (for
    methods such as ``generate`` called instead of forward).

    The full parameters stay in place until the method returns, also when it calls
    ``self(...)`` first and uses the parameters after that forward (torch's keep them only for
    the root and ``reshard_after_forward=False`` units).

    As torch's: a module that heads no ``fully_shard`` unit is left alone (so code may call it
    with or without FSDP), and the method is looked up on the instance (one set on it, or a
    method another registration already wrapped, is wrapped too).

    Raises:
        ValueError: ``module`` has no attribute ``method_name`` (torch's message).
    """
    state = hooks.fsdp_state(module)
    if state is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _run_pre_hooks(module, args, kwargs)
        state.methods_running += 1
        try:
            output = method(*args, **kwargs)
        finally:
            state.methods_running -= 1
        return _run_post_hooks(module, args, output)

    setattr(module, method_name, wrapped)


def _run_pre_hooks(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    pre_hooks, _ = compat.forward_hooks(module)
    for hook, with_kwargs in pre_hooks:
        if with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _run_post_hooks(module: nn.Module, args: tuple, output: Any) -> Any:
    for hook in compat.forward_hooks(module)[1]:
        result = hook(module, args, output)
        if result is not None:
            output = result
    return output
