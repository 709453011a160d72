"""Materializing modules built on the meta device, one unit at a time.

A model built under ``torch.device("meta")`` has shapes but no storage. Each FSDP unit
materializes only the modules of its own region (after auto-wrap, so nested units have already
done theirs): each meta parameter the unit owns, and each meta buffer, gets storage on the
compute device (tied parameters stay tied), then ``param_init_fn`` is called on every module of
the region, or each such module's ``reset_parameters()``, breadth first (as torch's FSDP1). The
unit then copies its shards out and drops the full tensors, so initialization peaks at about the
shards plus one unit's full parameters.
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


def breadth_first(region: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``region``'s (prefix, module) pairs, given in depth-first order with prefixes ending in
    ".", reordered breadth first: the order torch's FSDP1 initializes a unit's modules in, so
    that seeded initializations draw the same random numbers. (A tree's depth-first order
    stably sorted by depth is its breadth-first order.)"""
    return sorted(region, key=lambda named: named[0].count("."))


def materialize(
    region: Iterable[tuple[str, nn.Module]],
    owned: list[tuple[str, nn.Parameter, list[Any]]],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> list[tuple[str, nn.Parameter, list[Any]]]:
    """Give the unit's meta parameters and its modules' meta buffers storage, then initialize.

    Each meta parameter the unit owns gets one new tensor on ``device``, put at every slot, so
    tied parameters stay tied (``to_empty`` would untie them). Then, when anything of the unit
    was on the meta device, ``param_init_fn(module)`` is called on every module of ``region``
    (as torch's FSDP1 does: the function decides what each module needs); without one, each
    module that had meta tensors calls its own ``reset_parameters()``. Both in ``region``'s
    order (breadth first, as torch's).

    Args:
        region: (qualified name, module) pairs: the unit's own modules, nested units excluded,
            in initialization order.
        owned: (fqn, parameter, slots) of the parameters the unit owns.
        device: where the materialized tensors live.
        param_init_fn: called on each module of the region.

    Returns:
        ``owned`` with the new parameters in place of the meta ones.

    Raises:
        ValueError: a meta module has no ``reset_parameters()`` and no ``param_init_fn`` is
            given; the message names the module.
    """
    region = list(region)
    touched: dict[int, tuple[str, nn.Module]] = {}  # modules that had meta tensors, in order
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
        if param_init_fn is not None:
            if touched:
                _call_each(param_init_fn, [*region, *touched.values()])
            return out
        for name, m in touched.values():
            if not callable(getattr(m, "reset_parameters", None)):
                raise ValueError(
                    f"module {name or '<root>'} ({type(m).__name__}) is on the meta device and has no "
                    "reset_parameters(); give it one, or pass param_init_fn=fn where fn(module) fills "
                    "that module's own parameters and buffers"
                )
            m.reset_parameters()  # type: ignore[operator]
    return out


def _call_each(fn: Callable[[nn.Module], None], modules: Iterable[tuple[str, nn.Module]]) -> None:
    """``fn(module)`` once per module, in order (a module registered twice is called once)."""
    seen: set[int] = set()
    for _, m in modules:
        if id(m) not in seen:
            seen.add(id(m))
            fn(m)
