"""``fully_shard``: torch FSDP2's composable API on fullshard's engine.

``fully_shard(module)`` makes ``module`` an FSDP unit in place, without a wrapper: its class
becomes a subclass of both :class:`FSDPModule` and its own class, and forward hooks gather and
free its parameters. Apply it bottom-up (each transformer block, then the whole model); each
call owns the parameters no earlier call took. Parameter names do not change.

Its ``state_dict()`` holds ``DTensor`` shards (placement ``Shard(0)`` over the mesh, uneven
sizes allowed) whose ``.full_tensor()`` is the full value; ``load_state_dict`` takes those, or
full tensors, and keeps each rank's rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fullshard import _build as B
from fullshard import _collectives as C
from fullshard import _hooks as H
from fullshard._state_dict import as_dtensor
from fullshard._unit import Unit
from fullshard.api import BackwardPrefetch, MixedPrecision, ShardingStrategy, as_mp_policy, as_offload_policy


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision: gather and compute in ``param_dtype``, reduce in ``reduce_dtype``,
    cast floating-point outputs to ``output_dtype`` and inputs to ``param_dtype``."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


class OffloadPolicy:
    """No offloading (the base of CPUOffloadPolicy)."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards and gradients in CPU memory (pinned when ``pin_memory``); step there."""

    pin_memory: bool = True


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_unshard()


class FSDPModule:
    """Methods a module gains from ``fully_shard`` (it stays an instance of its own class too)."""

    def _units(self, recurse: bool) -> list[Unit]:
        assert isinstance(self, nn.Module)
        modules = self.modules() if recurse else [self]
        return [m.__dict__["_fsdp_state"].unit for m in modules if B.is_unit(m)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients locally and reduces nothing."""
        for unit in self._units(recurse):
            unit.sync_grads = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether to free the full parameters after forward (True) or keep them for backward."""
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now (the next forward then needs no gather)."""
        unit = self._units(recurse=False)[0]
        unit.unshard(async_op=async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this module's full parameters."""
        self._units(recurse=False)[0].reshard()


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def fully_shard(
    module: nn.Module,
    *,
    mesh: Optional[Any] = None,
    reshard_after_forward: bool = True,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload_policy: Optional[OffloadPolicy] = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those no earlier ``fully_shard`` took) over ``mesh``.

    Args:
        module: the module; it is changed in place and returned.
        mesh: a 1-D DeviceMesh to shard over, a 2-D one (replicate, shard) for hybrid
            sharding, or None for the whole world.
        reshard_after_forward: free the full parameters after forward (the root keeps them).
        mp_policy: a MixedPrecisionPolicy (fullshard's or torch.distributed.fsdp's).
        offload_policy: CPUOffloadPolicy() to keep shards in CPU memory (GPU runs); fullshard's
            or torch.distributed.fsdp's.

    Returns:
        ``module``, now also an FSDPModule.

    Raises:
        ValueError: ``module`` already heads a unit; it or a submodule was sharded by torch's FSDP
            or is a fullshard FullyShardedDataParallel; a mesh of more than 2 dimensions.
        TypeError: a policy of a type neither fullshard's nor torch's.
        RuntimeError: no process group is initialized.
    """
    B.check_not_sharded_elsewhere(module, "fully_shard")
    mp_policy = as_mp_policy(mp_policy, MixedPrecisionPolicy)
    offload_policy = as_offload_policy(offload_policy, OffloadPolicy, CPUOffloadPolicy)
    if B.is_unit(module):
        raise ValueError(f"{type(module).__name__} is already sharded (fully_shard or FullyShardedDataParallel); apply it once")
    hybrid = mesh is not None and mesh.ndim == 2
    strategy = ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD
    groups = B.resolve_groups(None, mesh, strategy)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    prepared = B.prepare(module, None, offload, set())
    mp = None
    if mp_policy is not None:
        mp = MixedPrecision(mp_policy.param_dtype, mp_policy.reduce_dtype, cast_forward_inputs=mp_policy.cast_forward_inputs)
    config = B.unit_config(prepared.device, reshard_after_forward, mp, offload)
    unit = B.build_unit(module, prepared, groups, config, set(), None, False, None)
    state = H.UnitHooks(unit, mixed_precision=mp, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    module.__dict__["_fsdp_state"] = state
    output_dtype = mp_policy.output_dtype if mp_policy else None
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(lambda m, args, out: _post_forward(m, out, output_dtype))
    _register_state_dict_hooks(module, unit, mesh, prepared.device)
    module.__class__ = _fsdp_class(type(module))
    return module


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    state = H.lazy_init(module)
    args, kwargs = H.prepare_inputs(state, (args, kwargs))
    H.pre_forward(state)
    return args, kwargs


def _post_forward(module: nn.Module, output: Any, output_dtype: Optional[torch.dtype]) -> Any:
    output = H.post_forward(module.__dict__["_fsdp_state"], output)
    if output_dtype is not None:
        output = tree_map(lambda t: t.to(output_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
    return output


def _register_state_dict_hooks(module: nn.Module, unit: Unit, mesh: Any, device: torch.device) -> None:
    """state_dict(): shards as DTensors; load_state_dict(): DTensors or full tensors -> shards."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    keys = [(sp, f"{names[id(slot.module)]}.{slot.attr}".lstrip(".")) for sp in unit.params for slot in sp.slots]
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (C.group_size(C.default_group()),))
    placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]

    def to_dtensors(m: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for sp, rel in keys:
            if prefix + rel in state_dict:
                state_dict[prefix + rel] = as_dtensor(sp, state_dict[prefix + rel], unit, mesh, placements)

    def from_full(m: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for sp, rel in keys:
            value = state_dict.get(prefix + rel)
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if isinstance(value, torch.Tensor) and value.shape == sp.spec.orig_shape:
                state_dict[prefix + rel] = sp.spec.local_slice(value).reshape(sp.spec.local_shape)

    module._register_state_dict_hook(to_dtensors)
    module._register_load_state_dict_pre_hook(from_full, with_module=True)
