"""A module that wraps one child module and stays transparent to its users.

FullyShardedDataParallel and CheckpointWrapper both hold the wrapped module under one
attribute name; attributes they lack are looked up on it, and parameter and buffer names
leave the wrapper attribute out, so names are the original model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fullshard import compat

FSDP_WRAPPED = "_fsdp_wrapped_module"
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
_PREFIXES = (FSDP_WRAPPED + ".", CHECKPOINT_WRAPPED + ".")


def clean_name(name: str) -> str:
    """A parameter, buffer or module name without fullshard's wrapper attributes
    (``blocks.0._checkpoint_wrapped_module.fc.weight`` -> ``blocks.0.fc.weight``)."""
    for prefix in _PREFIXES:
        name = name.replace(prefix, "")
    for wrapped in (FSDP_WRAPPED, CHECKPOINT_WRAPPED):  # a module name may end in one: "blocks.0._checkpoint_..."
        if name == wrapped or name.endswith("." + wrapped):
            name = name[: -len(wrapped)].rstrip(".")
    return name


class ModuleWrapper(nn.Module):
    """Base of the wrappers: ``module`` is the wrapped child, stored under ``wrapped_key``."""

    wrapped_key: str = ""

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return compat.module_children(self)[self.wrapped_key]  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__["_modules"].get(self.wrapped_key)
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key: Any) -> Any:
        return self.module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Like nn.Module's, with the original module's names (no wrapper attributes)."""
        for name, p in super().named_parameters(*args, **kwargs):
            yield clean_name(name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Like nn.Module's, with the original module's names (no wrapper attributes)."""
        for name, b in super().named_buffers(*args, **kwargs):
            yield clean_name(name), b
