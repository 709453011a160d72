"""``fully_shard``: torch FSDP2's composable API on fullshard's engine.

``fully_shard(module)`` makes ``module`` an FSDP unit in place, without a wrapper: its class
becomes a subclass of both :class:`FSDPModule` and its own class, and forward hooks gather and
free its parameters. Apply it bottom-up (each transformer block, then the whole model); each
call owns the parameters no earlier call took. Parameter names do not change.

As in torch's FSDP2, every parameter is then a ``DTensor`` of its full shape, placed
``Shard(0)`` on the unit's mesh (``(Replicate(), Shard(0))`` on a 2-D mesh for hybrid
sharding), whose local tensor is this rank's rows (torch.chunk layout, possibly 0 rows), a view
into the unit's local flat buffer. So are the gradients after backward and the values of
``state_dict()``. torch's tools built on DTensor work on them as they are:
``torch.nn.utils.clip_grad_norm_`` returns the global norm, ``full_tensor()`` the full value,
the ``torch.distributed.checkpoint.state_dict`` functions save and load full and sharded
state, and optimizers keep DTensor state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fullshard.comm import collectives
from fullshard.engine import build, hooks
from fullshard.engine.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from fullshard.engine.shard_sync import register_dtensors
from fullshard.engine.unit import ShardState, Unit
from fullshard.frontend import optim_local
from fullshard.frontend.options import as_mp_policy, as_offload_policy


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
        _register_unsharded(self._unit)


def _state(module: nn.Module) -> hooks.UnitHooks:
    state = hooks.fsdp_state(module)
    assert state is not None, "an FSDPModule always heads a unit"
    return state


class FSDPModule:
    """Methods a module gains from ``fully_shard`` (it stays an instance of its own class too)."""

    def _units(self, recurse: bool) -> list[Unit]:
        assert isinstance(self, nn.Module)
        modules = self.modules() if recurse else [self]
        units = {id(_state(m).unit): _state(m).unit for m in modules if build.is_unit(m)}
        return list(units.values())

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients locally and reduces nothing."""
        for unit in self._units(recurse):
            unit.sync_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: with False, gradients are reduce-scattered within the shard group and
        summed locally; the all-reduce across replicas happens (on the sum) at the next backward
        with True. No effect without a replicate dimension."""
        for unit in self._units(recurse):
            unit.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether to free the full parameters after forward (True) or keep them for backward."""
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, the full parameters stay gathered after backward (for gradient
        accumulation without a new all-gather); set True again before the optimizer step's
        last backward, or the next forward would use parameters from before the step."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API and ignored: fullshard always waits for every reduction at
        the end of backward, so results never depend on this flag (torch may then skip that
        wait)."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the data-parallel
        world size (this module's own unit only, as torch's; call it on each module to change).

        Raises:
            ValueError: ``factor`` is not positive.
        """
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor}")
        for unit in self._units(recurse=False):
            unit.divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's forward starts, start the all-gathers of ``modules`` (in order)
        instead of the default (none, or the next unit with ``forward_prefetch``)."""
        _state(self).prefetch_in_forward = [_unit_of(m, "set_modules_to_forward_prefetch") for m in modules]  # type: ignore[arg-type]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's backward starts, start the all-gathers of ``modules`` (in order)
        instead of the default (the unit that ran before it in forward)."""
        _state(self).prefetch_in_backward = [_unit_of(m, "set_modules_to_backward_prefetch") for m in modules]  # type: ignore[arg-type]

    def set_post_optim_event(self, event: Any) -> None:
        """A CUDA event (recorded after the optimizer step) that the next forward's all-gathers
        wait for, instead of the whole current stream. Call on the root module."""
        state = hooks.lazy_init(self)  # type: ignore[arg-type]
        assert state.root is not None
        state.root.post_optim_event = event

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now; while gathered, ``parameters(recurse=False)``
        yields the full parameters (in ``param_dtype``), as torch's does. The next forward then
        needs no all-gather; ``reshard()`` or the end of forward/backward frees them."""
        hooks.lazy_init(self)  # type: ignore[arg-type]
        unit = self._units(recurse=False)[0]
        unit.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(unit)
        _register_unsharded(unit)
        return None

    def reshard(self) -> None:
        """Free this module's full parameters; the shards are registered again."""
        self._units(recurse=False)[0].reshard()


def _unit_of(module: Any, caller: str) -> Unit:
    if not isinstance(module, nn.Module) or not build.is_unit(module):
        raise TypeError(f"{caller}: every module must be one given to fully_shard, got {type(module).__name__}")
    return _state(module).unit


def _register_unsharded(unit: Unit) -> None:
    """Register the full parameters (views of the gathered buffer) in the shards' places until
    the unit reshards, as torch's FSDP2 shows unsharded parameters after ``unshard()``."""
    if unit.shard_state is not ShardState.UNSHARDED:
        return
    for sp, full in zip(unit.params, unit.full_params()):
        sp.swap_registered(nn.Parameter(full.detach(), requires_grad=sp.requires_grad))
    unit.on_reshard = _restore_shards


def _restore_shards(unit: Unit) -> None:
    for sp in unit.params:
        if sp.swapped:
            assert sp.shard is not None
            sp.register_shard(sp.shard)
    unit.on_reshard = None


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


_DEFAULT_MESHES: dict[tuple[int, str], Any] = {}


def _default_mesh(device_type: str) -> Any:
    """A 1-D DeviceMesh over the default group (one per process group and device type)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(collectives.default_group()), device_type)
    if key not in _DEFAULT_MESHES:
        _DEFAULT_MESHES[key] = init_device_mesh(device_type, (collectives.group_size(collectives.default_group()),))
    return _DEFAULT_MESHES[key]


def _mesh_device(mesh: Any) -> torch.device | None:
    """The compute device a mesh implies (CUDA's current device for a CUDA mesh)."""
    if mesh is None or mesh.device_type == "cpu":
        return None
    return (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )


def _as_reshard_after_forward(value: Union[bool, int, None], shard_size: int) -> tuple[bool, int | None]:
    """FSDP2's ``reshard_after_forward`` as (reshard, size of the group to reshard to).

    A bool; None (True: the root keeps its parameters anyway); or an int M dividing the shard
    group's size: after forward each rank keeps 1/M of the parameters and backward all-gathers
    within a group of M ranks (1 keeps the full parameters, the shard group's size is True).

    Raises:
        ValueError: an int that does not divide the shard group's size, or another type.
    """
    if value is None or isinstance(value, bool):
        return (True if value is None else value), None
    if isinstance(value, int) and value >= 1:
        if shard_size % value:
            raise ValueError(
                f"fully_shard: reshard_after_forward={value} must divide the shard group's size ({shard_size}), "
                "as torch's: the number of ranks to reshard to after forward"
            )
        if value == 1:
            return False, None
        return True, (value if value != shard_size else None)
    raise ValueError(f"fully_shard: reshard_after_forward must be a bool, None or a positive int, got {value!r}")


_POST_FORWARD_MESHES: dict[tuple[int, int], Any] = {}


def _post_forward_group(mesh: Any, size: int) -> Any:
    """The group of ``size`` consecutive ranks of the mesh's shard dimension holding this rank
    (created collectively, once per mesh and size, as torch's: the mesh viewed as (-1, size))."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(mesh), size)
    if key not in _POST_FORWARD_MESHES:
        _POST_FORWARD_MESHES[key] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size))
    return _POST_FORWARD_MESHES[key].get_group(1)


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[Any] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload_policy: Optional[OffloadPolicy] = None,
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
) -> Any:
    """Shard ``module``'s parameters (those no earlier ``fully_shard`` took) over ``mesh``.

    Each parameter of shape (d0, *rest) becomes a DTensor of that shape (placement Shard(0))
    whose local tensor holds this rank's ceil(d0 / N)-row chunk; on the meta device it stays
    there (call ``module.to_empty(device=...)`` and initialize, or load a state dict with
    ``assign=True``; the values are taken into the unit at the first forward).

    Args:
        module: the module, or a list of modules sharded together as one unit (gathered at
            the first of their forwards, freed after the last); changed in place and returned.
        mesh: a 1-D DeviceMesh to shard over, a 2-D one (replicate, shard) for hybrid
            sharding, or None for the whole world (on the accelerator if there is one).
        reshard_after_forward: free the full parameters after forward (the root keeps them);
            an int M keeps 1/M of them so backward gathers within M ranks; see
            :func:`_as_reshard_after_forward`.
        shard_placement_fn: may return ``Shard(0)`` or None for each parameter (other dims are
            not supported).
        mp_policy: a MixedPrecisionPolicy (fullshard's or torch.distributed.fsdp's).
        offload_policy: CPUOffloadPolicy() to keep shards in CPU memory (GPU runs); fullshard's
            or torch.distributed.fsdp's.
        ignored_params: parameters to leave unsharded, unreduced and where they are.

    Returns:
        ``module``, now also an FSDPModule (the list, for a list).

    Raises:
        TypeError: a policy of a type neither fullshard's nor torch's.
        ValueError: ``module`` already heads a unit; it or a submodule was sharded by torch's
            FSDP or is a fullshard FullyShardedDataParallel; a mesh of more than 2 dimensions; a 0-dim
            parameter (as torch's fully_shard: make it shape (1,) or ignore it).
        NotImplementedError: a placement other than Shard(0).
        RuntimeError: no process group is initialized.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard: module is an empty list; pass a module or a non-empty list of modules")
    for m in modules:
        build.check_not_sharded_elsewhere(m, "fully_shard")
    mp_policy = as_mp_policy(mp_policy, MixedPrecisionPolicy)
    offload_policy = as_offload_policy(offload_policy, OffloadPolicy, CPUOffloadPolicy)
    for m in modules:
        if build.is_unit(m):
            raise ValueError(
                f"{type(m).__name__} is already sharded (fully_shard or FullyShardedDataParallel); apply it once"
            )
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard: mesh must have 1 or 2 dimensions, got {mesh.ndim}")
    for p in ignored_params or ():
        p._fullshard_ignored = True  # type: ignore[attr-defined]
    if mesh is None:
        mesh = _default_mesh("cuda" if torch.cuda.is_available() else "cpu")
    hybrid = mesh.ndim == 2
    groups = build.resolve_groups(None, mesh, ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    holder = modules[0] if len(modules) == 1 else _ModuleGroup(modules)
    prepared = build.prepare(holder, _mesh_device(mesh), offload, set())
    _check_params(holder, shard_placement_fn)
    mp = None
    if mp_policy is not None:
        mp = MixedPrecision(
            mp_policy.param_dtype, mp_policy.reduce_dtype, cast_forward_inputs=mp_policy.cast_forward_inputs
        )
    shard_size = collectives.group_size(groups.shard) if groups.shard is not None else 1
    reshard, post_forward_size = _as_reshard_after_forward(reshard_after_forward, shard_size)
    config = build.unit_config(prepared.device, reshard, mp, offload)
    unit = build.build_unit(holder, prepared, groups, config, set(), None, False, None, materialize_meta=False)
    if post_forward_size is not None:
        unit.set_post_forward_group(_post_forward_group(mesh, post_forward_size))
    from torch.distributed.tensor import Replicate, Shard

    register_dtensors(unit, mesh, [Replicate(), Shard(0)] if hybrid else [Shard(0)])
    optim_local.install()  # optimizer steps run on the local tensors (same bits, no DTensor dispatch)
    state = hooks.UnitHooks(unit, mixed_precision=mp, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    output_dtype = mp_policy.output_dtype if mp_policy else None
    _register_forward_hooks(modules, state, output_dtype)
    for m in modules:
        hooks.set_fsdp_state(m, state)
        _register_state_dict_hooks(m, unit)
        m.__class__ = _fsdp_class(type(m))
    return module


class _ModuleGroup(nn.Module):
    """Several modules seen as one tree while ``fully_shard`` builds their shared unit."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)


def _check_params(module: nn.Module, shard_placement_fn: Optional[Callable[[nn.Parameter], Any]]) -> None:
    from torch.distributed.tensor import Shard

    for name, p in module.named_parameters():
        if hasattr(p, "_fullshard_param") or hasattr(p, "_fullshard_ignored"):
            continue
        if p.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard the 0-dim parameter {name!r} (torch's fully_shard cannot "
                "either): make it a tensor of shape (1,), or pass it in ignored_params"
            )
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None
        if placement is not None and not (isinstance(placement, Shard) and placement.dim in (0, -p.dim())):
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned {placement} for {name!r}; fullshard shards "
                "along dim 0 only (return Shard(0) or None)"
            )


def _register_forward_hooks(
    modules: list[nn.Module], state: hooks.UnitHooks, output_dtype: Optional[torch.dtype]
) -> None:
    """Gather before the first of ``modules`` runs forward and free after the last one has."""
    pending: set[int] = set()
    ids = {id(m) for m in modules}

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hooks.lazy_init(module)
        args, kwargs = hooks.prepare_inputs(state, (args, kwargs))
        if not pending:
            pending.update(ids)
            hooks.pre_forward(state)
        return args, kwargs

    def post(module: nn.Module, args: tuple, output: Any) -> Any:
        pending.discard(id(module))
        if not pending:
            output = hooks.post_forward(state, output)
        if output_dtype is not None:
            output = tree_map(
                lambda t: t.to(output_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output
            )
        return output

    for m in modules:
        m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        m.register_forward_hook(post)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and free parameters as ``forward`` does (for
    methods such as ``generate`` called instead of forward).

    Raises:
        ValueError: ``module`` was not given to fully_shard.
        AttributeError: it has no such method.
    """
    if not build.is_unit(module):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} was not given to fully_shard")
    method = getattr(type(module), method_name)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _run_pre_hooks(module, args, kwargs)
        output = method(module, *args, **kwargs)
        return _run_post_hooks(module, args, output)

    setattr(module, method_name, wrapped)


def _run_pre_hooks(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    for key, hook in module._forward_pre_hooks.items():
        if key in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _run_post_hooks(module: nn.Module, args: tuple, output: Any) -> Any:
    for hook in module._forward_hooks.values():
        result = hook(module, args, output)
        if result is not None:
            output = result
    return output


def _register_state_dict_hooks(module: nn.Module, unit: Unit) -> None:
    """``load_state_dict`` also takes full tensors (and DTensors of any placement): each becomes
    this rank's rows as a DTensor like the parameter, so ``param.copy_`` (or ``assign=True``,
    taken into the unit at the next forward) works."""
    from torch.distributed.tensor import DTensor

    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    keys = [
        (sp, f"{names[id(slot.module)]}.{slot.attr}".lstrip("."))
        for sp in unit.params
        for slot in sp.slots
        if id(slot.module) in names
    ]

    def from_full(m: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for sp, rel in keys:
            value = state_dict.get(prefix + rel)
            if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                continue
            if value.shape == sp.spec.orig_shape:
                value = sp.spec.local_slice(value).reshape(sp.spec.local_shape)
            if value.shape == sp.spec.local_shape:
                state_dict[prefix + rel] = sp.as_registered(value.to(sp.local.device))

    module._register_load_state_dict_pre_hook(from_full, with_module=True)
