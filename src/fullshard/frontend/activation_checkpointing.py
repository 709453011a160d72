"""Activation checkpointing: recompute a module's forward during backward instead of keeping
its activations, on ``torch.utils.checkpoint`` (non-reentrant).

``checkpoint_wrapper(module)`` works inside and outside FSDP units. When the recomputation runs
inside a unit that freed its parameters after forward, the unit's pre-backward hook has already
gathered them again, so the recomputed forward sees the full parameters.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fullshard.engine.module_wrapper import CHECKPOINT_WRAPPED as WRAPPED
from fullshard.engine.module_wrapper import ModuleWrapper

_PREFIX = WRAPPED + "."


class CheckpointWrapper(ModuleWrapper):
    """Runs the wrapped module under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

    Only the module's inputs are kept for backward; its forward runs again during backward.
    With ``offload_to_cpu`` those kept inputs are moved to (pinned) CPU memory too.
    Parameter and state-dict names are the wrapped module's (no wrapper prefix).

    Args:
        module: the module to wrap.
        offload_to_cpu: keep the saved inputs in CPU memory (useful on GPUs only).
        checkpoint_kwargs: passed on to ``torch.utils.checkpoint.checkpoint`` (``context_fn``
            for selective checkpointing, ``preserve_rng_state``, ``determinism_check``, ``debug``,
            ``early_stop``).
    """

    wrapped_key = WRAPPED

    def __init__(
        self, module: nn.Module, offload_to_cpu: bool = False, checkpoint_kwargs: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        if isinstance(module, CheckpointWrapper):
            raise ValueError("module is already a CheckpointWrapper; wrap each module once")
        self.offload_to_cpu = offload_to_cpu
        self.checkpoint_kwargs = dict(checkpoint_kwargs or {})
        self.add_module(WRAPPED, module)
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        saving: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.offload_to_cpu:
            saving = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        with saving:
            if self.checkpoint_kwargs:
                fn = functools.partial(self.module, **kwargs) if kwargs else self.module
                return checkpoint(fn, *args, use_reentrant=False, **self.checkpoint_kwargs)
            return checkpoint(self.module, *args, use_reentrant=False, **kwargs)


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix + _PREFIX):
            state_dict[prefix + key[len(prefix + _PREFIX) :]] = state_dict.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + _PREFIX):
            state_dict[prefix + _PREFIX + key[len(prefix) :]] = state_dict.pop(key)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False, **kwargs: Any) -> CheckpointWrapper:
    """Wrap ``module`` so its activations are recomputed in backward (see CheckpointWrapper).

    Takes torch's ``checkpoint_wrapper`` keywords: ``checkpoint_impl`` (non-reentrant only) and
    the keywords of ``torch.utils.checkpoint.checkpoint`` (``context_fn=`` with
    ``create_selective_checkpoint_contexts`` for selective checkpointing, ``preserve_rng_state``,
    ``determinism_check``, ``debug``, ``early_stop``).

    Raises:
        TypeError: ``checkpoint_impl=REENTRANT``, or a keyword neither of these accepts.
    """
    impl = kwargs.pop("checkpoint_impl", None)
    if impl is not None and "REENTRANT" == getattr(impl, "name", impl):
        raise TypeError("checkpoint_impl=REENTRANT is not supported: fullshard checkpoints non-reentrantly")
    unknown = sorted(set(kwargs) - _CHECKPOINT_KWARGS)
    if unknown:
        raise TypeError(
            f"checkpoint_wrapper got unexpected keyword argument(s) {unknown}; it takes offload_to_cpu, "
            f"checkpoint_impl and torch.utils.checkpoint.checkpoint's {sorted(_CHECKPOINT_KWARGS)}"
        )
    return CheckpointWrapper(module, offload_to_cpu=offload_to_cpu, checkpoint_kwargs=kwargs)


_CHECKPOINT_KWARGS = frozenset({"context_fn", "preserve_rng_state", "determinism_check", "debug", "early_stop"})


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] | None = None,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Any | None = None,
    offload_to_cpu: bool = False,
) -> None:
    """Wrap, in place, every submodule of ``model`` for which ``check_fn`` is true.

    Works before or after FSDP wrapping. Modules already wrapped are left alone, and the
    wrapped modules' children are not visited.

    Args:
        model: the model to modify.
        checkpoint_wrapper_fn: builds the wrapper (default: ``checkpoint_wrapper`` with
            ``offload_to_cpu``).
        check_fn: selects modules.
        auto_wrap_policy: not supported; pass ``check_fn``.
        offload_to_cpu: passed to the default wrapper.

    Raises:
        NotImplementedError: an ``auto_wrap_policy`` is given.
    """
    if auto_wrap_policy is not None:
        raise NotImplementedError("apply_activation_checkpointing: pass check_fn= instead of auto_wrap_policy=")
    wrap = checkpoint_wrapper_fn or (lambda m: checkpoint_wrapper(m, offload_to_cpu=offload_to_cpu))

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper):
                continue
            if check_fn(child):
                setattr(parent, name, wrap(child))
            else:
                visit(child)

    visit(model)
