"""The state-dict mapping: between a sharded FSDP tree and full tensors under original names.

A full state dict holds, for every parameter and persistent buffer of the unwrapped model, a
tensor of its original shape under its original name. Building one gathers one unit at a time;
loading one copies each rank's rows into its shards. Both are collective when a unit has more
than one rank: every rank of the group must call them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from fullshard._module_wrapper import ModuleWrapper
from fullshard._sharded_param import ShardedParam

if TYPE_CHECKING:
    from fullshard.fully_sharded_data_parallel import FullyShardedDataParallel


def _entries(root: nn.Module, ignored: set[nn.Module]) -> Iterator[tuple[str, nn.Module, str, bool]]:
    """(clean name, owning module, attribute, is_parameter) in nn.Module.state_dict order."""
    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, str, bool]]:
        if isinstance(module, ModuleWrapper):  # wrappers are transparent in names
            yield from walk(module.module, prefix)
            return
        for name, p in module._parameters.items():
            if p is not None:
                yield prefix + name, module, name, True
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                yield prefix + name, module, name, False
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(root, "")


def _sharded(t: torch.Tensor) -> ShardedParam | None:
    return getattr(t, "_fullshard_param", None)


def full_state_dict(root: FullyShardedDataParallel, ignored: set[nn.Module]) -> OrderedDict[str, torch.Tensor]:
    """Full tensors under original names, gathering one unit at a time (collective)."""
    full: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for fsdp in root.fsdp_modules(root):
            unit = fsdp.unit
            for sp, value in zip(unit.params, unit.gather_full(unit.local_flat)):
                full[id(sp)] = value
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, module, attr, is_param in _entries(root, ignored):
        t = module._parameters[attr] if is_param else module._buffers[attr]
        assert t is not None
        owner = _sharded(t)
        if owner is not None:
            out[name] = full[id(owner)]
        else:
            original = module.__dict__.get("_fullshard_buffer_dtypes", {}).get(attr, t.dtype)
            out[name] = t.detach().to(original)
    return out


def load_full_state_dict(
    root: FullyShardedDataParallel,
    state_dict: Mapping[str, Any],
    strict: bool,
    ignored: set[nn.Module],
) -> _IncompatibleKeys:
    """Copy a full state dict into the shards and buffers; validate everything first."""
    entries = list(_entries(root, ignored))
    expected = {name for name, *_ in entries}
    missing = [name for name in expected if name not in state_dict]
    missing.sort(key=[n for n, *_ in entries].index)
    unexpected = [k for k in state_dict if k not in expected]
    errors = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, full value), checked
    for name, module, attr, is_param in entries:
        if name not in state_dict:
            continue
        value = state_dict[name]
        target = module._parameters[attr] if is_param else module._buffers[attr]
        assert target is not None
        sp = _sharded(target)
        shape = sp.spec.orig_shape if sp is not None else target.shape
        copies.append((target, value))
        if not isinstance(value, torch.Tensor):
            errors.append(f"value for {name} is a {type(value).__name__}, expected a tensor")
        elif value.shape != shape:
            errors.append(
                f"size mismatch for {name}: copying a param with shape {tuple(value.shape)} from "
                f"checkpoint, the shape in current model is {tuple(shape)}."
            )
    if strict and (missing or unexpected):
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(root.module).__name__}:\n\t" + "\n\t".join(errors)
        )
    with torch.no_grad():
        for target, value in copies:
            sp = _sharded(target)
            if sp is not None:
                src = sp.spec.local_slice(value.to(target.device, target.dtype))
                target.copy_(src.reshape(target.shape))
            else:
                target.copy_(value)
    return _IncompatibleKeys(missing, unexpected)
