"""The state-dict mapping: between a sharded FSDP tree and full tensors under original names.

A full state dict holds, for every parameter and persistent buffer of the unwrapped model, a
tensor of its original shape under its original name. Building one gathers one unit at a time;
loading one copies each rank's rows into its shards. Both are collective when a unit has more
than one rank: every rank of the group must call them.

Every function here takes the root module of an FSDP tree (a ``FullyShardedDataParallel``, or
any module whose tree holds units) and finds the units through their FSDP state
(:func:`~fullshard.engine.hooks.fsdp_state`), never through a front end's class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Collection

import torch
from torch import nn

from fullshard import compat
from fullshard.comm import collectives
from fullshard.engine.hooks import fsdp_state
from fullshard.engine.module_wrapper import CHECKPOINT_WRAPPED, ModuleWrapper
from fullshard.engine.sharded_param import ShardedParam, unshifted
from fullshard.engine.unit import Unit

Modules = AbstractSet[nn.Module]


def tree_units(root: nn.Module) -> list[Unit]:
    """The units of ``root``'s tree, each once, in ``root.modules()`` order (the same on every rank)."""
    found: dict[int, Unit] = {}
    for m in root.modules():
        state = fsdp_state(m)
        if state is not None:
            found.setdefault(id(state.unit), state.unit)
    return list(found.values())


def _entries(root: nn.Module, ignored: Modules) -> Iterator[tuple[str, nn.Module, str, bool]]:
    """(clean name, owning module, attribute, is_parameter) in nn.Module.state_dict order."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, str, bool]]:
        if isinstance(module, ModuleWrapper):  # wrappers are transparent in names
            yield from walk(module.module, prefix)
            return
        for name, p in compat.module_parameters(module).items():
            if p is not None:
                yield prefix + name, module, name, True
        for name, b in compat.module_buffers(module).items():
            if b is not None and name not in compat.non_persistent_buffers(module):
                yield prefix + name, module, name, False
        for name, child in compat.module_children(module).items():
            if child is not None:  # torch's checkpoint wrappers: transparent too, as torch's hooks make them
                yield from walk(child, prefix if name == CHECKPOINT_WRAPPED else f"{prefix}{name}.")

    yield from walk(root, "")


def _sharded(t: torch.Tensor) -> ShardedParam | None:
    return getattr(t, "_fullshard_param", None)


def full_state_dict(
    root: nn.Module, ignored: Modules, rank0_only: bool = False, offload_to_cpu: bool = False
) -> OrderedDict[str, torch.Tensor]:
    """Full tensors under original names, gathering one unit at a time (collective).

    With ``rank0_only`` (rank 0 of the units' shard and replicate groups: each slice's first rank
    when they span a slice of a mesh) the other ranks drop each unit right after its all-gather and return an
    empty dict, so they never hold more than one unit; with ``offload_to_cpu`` each unit moves to
    CPU memory as soon as it is gathered.
    """
    units = tree_units(root)
    keep = not rank0_only or (
        units[0].first_data_parallel_rank if units else collectives.group_rank(collectives.default_group()) == 0
    )
    full: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for unit in units:
            values = unit.gather_full(unit.local_flat)
            if keep:
                for sp, value in zip(unit.params, values):
                    full[id(sp)] = value.to("cpu", copy=True) if offload_to_cpu else value
            del values
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    if not keep:
        return out
    for name, module, attr, is_param in _entries(root, ignored):
        t = compat.module_parameters(module)[attr] if is_param else compat.module_buffers(module)[attr]
        assert t is not None
        owner = _sharded(t)
        if owner is not None:
            out[name] = full[id(owner)]
        else:
            out[name] = t.detach().to("cpu" if offload_to_cpu else t.device, _saved_dtype(module, attr, t))
    return out


def _saved_dtype(module: nn.Module, attr: str, t: torch.Tensor) -> torch.dtype:
    """The dtype a state dict holds ``module.attr`` in: a buffer's dtype before ``buffer_dtype``."""
    dtypes: dict[str, torch.dtype] = module.__dict__.get("_fullshard_buffer_dtypes", {})
    return dtypes.get(attr, t.dtype)


def local_state_dict(root: nn.Module, ignored: Modules, offload_to_cpu: bool = False) -> OrderedDict[str, torch.Tensor]:
    """This rank's shards (and the buffers) as plain tensors under the original names."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, module, attr, is_param in _entries(root, ignored):
        t = compat.module_parameters(module)[attr] if is_param else compat.module_buffers(module)[attr]
        assert t is not None
        out[name] = t.detach().cpu() if offload_to_cpu else t.detach()
    return out


def load_full_state_dict(
    root: nn.Module,
    state_dict: Mapping[str, Any],
    strict: bool,
    ignored: Modules,
    shards: Collection[str] = (),
) -> compat.IncompatibleKeys:
    """Copy a full state dict into the shards and buffers; validate everything first.

    Keys in ``shards`` hold this rank's shard (the shard's shape) instead of the full value.
    """
    entries = list(_entries(root, ignored))
    order = [n for n, *_ in entries]
    expected = set(order)
    missing = sorted((n for n in expected if n not in state_dict), key=order.index)
    unexpected = [k for k in state_dict if k not in expected]
    errors = []
    copies: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (target, value, value is full)
    for name, module, attr, is_param in entries:
        if name not in state_dict:
            continue
        value = state_dict[name]
        target = compat.module_parameters(module)[attr] if is_param else compat.module_buffers(module)[attr]
        assert target is not None
        sp = _sharded(target)
        is_full = name not in shards
        shape = sp.spec.orig_shape if sp is not None and is_full else target.shape
        if not isinstance(value, torch.Tensor) and torch.overrides.is_tensor_like(value):
            # as torch's load_state_dict, any tensor-like (e.g. Lightning's lazily loaded tensors):
            # the first torch function on it (here a clone) gives the real tensor
            value = torch.clone(value)
        if not isinstance(value, torch.Tensor):
            errors.append(f"value for {name} is a {type(value).__name__}, expected a tensor or tensor-like")
        elif value.shape != shape:
            errors.append(
                f"size mismatch for {name}: copying a param with shape {value.shape} from "
                f"checkpoint, the shape in current model is {torch.Size(shape)}."
            )
        else:
            copies.append((target, value, is_full))
    if strict and (missing or unexpected):  # torch's message, word for word: missing keys first
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}:\n\t" + "\n\t".join(errors))
    with torch.no_grad():
        for target, value, is_full in copies:
            sp = _sharded(target)
            if is_full and sp is not None:
                value = sp.spec.local_slice(value.to(target.device, target.dtype)).reshape(target.shape)
            if value.numel() and value.data_ptr() == target.data_ptr():
                continue  # loaded in place (a DTensor over this very shard)
            target.copy_(value)
    return compat.IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------------- sharded
def unit_mesh(unit: Unit) -> Any:
    """A 1-D DeviceMesh over the unit's shard group (cached); None when one rank holds it all."""
    if unit.shard_group is None:
        return None
    mesh = unit.__dict__.get("_mesh")
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(unit.shard_group, unit.device.type)
        unit.__dict__["_mesh"] = mesh
    return mesh


def as_dtensor(sp: ShardedParam, local: torch.Tensor, unit: Unit, mesh: Any, placements: list) -> Any:
    """This rank's rows of a parameter-shaped tensor as a DTensor of the full shape.

    ``local`` has the shard's shape (rows, *rest); the DTensor shares its storage, so a
    torch.distributed.checkpoint load into it writes the shard in place. A 0-dim value cannot
    be split: it becomes a replicated copy, broadcast from the rank that holds it (collective).
    """
    from torch.distributed.tensor import DTensor, Replicate

    shape = sp.spec.orig_shape
    if len(shape) == 0:
        group = unit.shard_group
        value = torch.zeros(
            (), dtype=local.dtype, device=collectives.reduction_device(group) if group is not None else local.device
        )
        if sp.spec.local_numel:
            value.copy_(local.detach().reshape(()))
        if group is not None:
            collectives.broadcast(value, 0, group)
        return DTensor.from_local(value.to(local.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
    stride = torch.empty(shape, device="meta").stride()
    rows = local.detach().reshape(sp.spec.local_shape)
    return unshifted(DTensor.from_local(rows, mesh, placements, run_check=False, shape=shape, stride=stride))


def _sharded_value(t: torch.Tensor, units: dict[int, Unit]) -> Any:
    sp = _sharded(t)
    if sp is None:
        return t.detach()
    unit = units[id(sp)]
    mesh = unit_mesh(unit)
    if mesh is None:  # held whole (NO_SHARD, one rank): a plain, replicated tensor
        return t.detach().reshape(sp.spec.orig_shape)
    from torch.distributed.tensor import Shard

    return as_dtensor(sp, t, unit, mesh, [Shard(0)])


def _unit_of_param(root: nn.Module) -> dict[int, Unit]:
    """id(sharded parameter) -> its unit, for every unit in ``root``'s tree (root need not be one)."""
    return {id(sp): unit for unit in tree_units(root) for sp in unit.params}


def sharded_state_dict(root: nn.Module, ignored: Modules) -> OrderedDict[str, Any]:
    """Original names -> DTensor shards (Shard(0) over each unit's shard group; uneven allowed).

    Parameters every rank holds whole and buffers are plain tensors (replicated). The DTensors
    share storage with the shards. Buffers are in their dtype before ``MixedPrecision``'s
    ``buffer_dtype`` (as torch FSDP1's full and sharded state dicts hold them). Collective only
    for 0-dim sharded parameters.
    """
    units = _unit_of_param(root)
    out: OrderedDict[str, Any] = OrderedDict()
    for name, module, attr, is_param in _entries(root, ignored):
        t = compat.module_parameters(module)[attr] if is_param else compat.module_buffers(module)[attr]
        assert t is not None
        out[name] = _sharded_value(t, units) if is_param else t.detach().to(_saved_dtype(module, attr, t))
    return out


def load_sharded_state_dict(
    root: nn.Module, state_dict: Mapping[str, Any], strict: bool, ignored: Modules
) -> compat.IncompatibleKeys:
    """Copy DTensor shards (this rank's layout) or full tensors into the model; validate first.

    Raises:
        RuntimeError: with ``strict``, missing or unexpected keys; a shape mismatch. Nothing
            is copied unless every entry fits.
    """
    from torch.distributed.tensor import DTensor

    values: dict[str, Any] = {}
    shards: set[str] = set()
    for k, v in state_dict.items():
        if isinstance(v, DTensor):
            if not all(p.is_replicate() for p in v.placements):
                shards.add(k)  # this rank's rows, in the current layout
            v = v.to_local()
        values[k] = v
    return load_full_state_dict(root, values, strict, ignored, shards=shards)
