"""Materializing modules built on the meta device, one unit at a time.

A model built under ``torch.device("meta")`` has shapes but no storage. Each FSDP unit
materializes only the modules of its own region (after auto-wrap, so nested units have already
done theirs): ``to_empty(recurse=False)`` allocates a module's own parameters and buffers on the
compute device, then ``param_init_fn(module)`` or ``module.reset_parameters()`` fills them. The
unit then copies its shards out and drops the full tensors, so initialization peaks at about the
shards plus one unit's full parameters.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn


def _own_tensors(m: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None]


def is_meta(modules: Iterable[nn.Module]) -> bool:
    """Whether any of these modules has a parameter or buffer of its own on the meta device."""
    return any(t.is_meta for m in modules for t in _own_tensors(m))


def materialize(
    region: Iterable[tuple[str, nn.Module]],
    device: torch.device,
    param_init_fn: Optional[Callable[[nn.Module], None]],
) -> None:
    """Give every meta module of ``region`` real storage on ``device`` and initialize it.

    Args:
        region: (qualified name, module) pairs: one unit's modules, nested units excluded.
        device: where the materialized tensors live.
        param_init_fn: called on each materialized module; when None, the module's own
            ``reset_parameters()`` is called instead.

    Raises:
        ValueError: a meta module has no ``reset_parameters()`` and no ``param_init_fn`` is
            given; the message names the module.
    """
    with torch.no_grad():
        for name, m in region:
            if not any(t.is_meta for t in _own_tensors(m)):
                continue
            m.to_empty(device=device, recurse=False)
            if param_init_fn is not None:
                param_init_fn(m)
            elif callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()  # type: ignore[operator]
            else:
                raise ValueError(
                    f"module {name or '<root>'} ({type(m).__name__}) is on the meta device and has no "
                    "reset_parameters(); give it one, or pass param_init_fn=fn where fn(module) fills "
                    "that module's own parameters and buffers"
                )
