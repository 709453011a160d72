"""Materializing modules built on the meta device, one unit at a time.

A model built under ``torch.device("meta")`` has shapes but no storage. Each FSDP unit
materializes only the modules of its own region (after auto-wrap, so nested units have already
done theirs): each meta parameter the unit owns, and each meta buffer, gets storage on the
compute device (tied parameters stay tied), then ``param_init_fn(module)`` or
``module.reset_parameters()`` fills them. The unit then copies its shards out and drops the full
tensors, so initialization peaks at about the shards plus one unit's full parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fullshard import compat


def own_tensors(m: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``m`` registers itself (not its children's)."""
    return [
        t for t in list(compat.module_parameters(m).values()) + list(compat.module_buffers(m).values()) if t is not None
    ]


def is_meta(modules: Iterable[nn.Module]) -> bool:
    """Whether any of these modules has a parameter or buffer of its own on the meta device."""
    return any(t.is_meta for m in modules for t in own_tensors(m))


def materialize(
    region: Iterable[tuple[str, nn.Module]],
    owned: list[tuple[str, nn.Parameter, list[Any]]],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> list[tuple[str, nn.Parameter, list[Any]]]:
    """Give the unit's meta parameters and its modules' meta buffers storage, then initialize.

    Each meta parameter the unit owns gets one new tensor on ``device``, put at every slot, so
    tied parameters stay tied (``to_empty`` would untie them). Then each module of ``region``
    that had meta tensors is initialized by ``param_init_fn(module)``, else by its own
    ``reset_parameters()``.

    Args:
        region: (qualified name, module) pairs: the unit's own modules, nested units excluded.
        owned: (fqn, parameter, slots) of the parameters the unit owns.
        device: where the materialized tensors live.
        param_init_fn: called on each materialized module.

    Returns:
        ``owned`` with the new parameters in place of the meta ones.

    Raises:
        ValueError: a meta module has no ``reset_parameters()`` and no ``param_init_fn`` is
            given; the message names the module.
    """
    touched: dict[int, tuple[str, nn.Module]] = {}  # modules to initialize, in order
    out = []
    with torch.no_grad():
        for name, m in region:
            for key, b in compat.module_buffers(m).items():
                if b is not None and b.is_meta:
                    compat.module_buffers(m)[key] = torch.empty_like(b, device=device)
                    touched[id(m)] = (name, m)
            if any(p is not None and p.is_meta for p in compat.module_parameters(m).values()):
                touched[id(m)] = (name, m)
        for fqn, p, slots in owned:
            if p.is_meta:
                p = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                for slot in slots:  # a tied parameter's slots may lie in nested units too
                    compat.module_parameters(slot.module)[slot.attr] = p
                    touched.setdefault(id(slot.module), (fqn.rpartition(".")[0], slot.module))
            out.append((fqn, p, slots))
        for name, m in touched.values():
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
    return out
