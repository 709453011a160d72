"""``FullyShardedDataParallel``: torch FSDP1's wrapper API on fullshard's engine.

Each instance wraps one module and owns one unit: the parameters of that module that no nested
``FullyShardedDataParallel`` owns. ``auto_wrap_policy`` creates the nested instances bottom-up.
The outermost instance to run forward becomes the root and coordinates the tree.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from fullshard import _collectives as C
from fullshard import _hooks as H
from fullshard import _state_dict as SD
from fullshard._sharded_param import ParamSlot, is_sharded
from fullshard._unit import TrainingState, Unit
from fullshard.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    parse_sharding_strategy,
)
from fullshard.wrap import apply_policy, as_policy

WRAPPED = "_fsdp_wrapped_module"
_PREFIX = WRAPPED + "."

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def clean_name(name: str) -> str:
    """A parameter or buffer name without fullshard's wrapper prefixes."""
    return name.replace(_PREFIX, "")


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across a process group.

    Same constructor as ``torch.distributed.fsdp.FullyShardedDataParallel``. After wrapping,
    ``parameters()`` yields this rank's shards: parameter ``p`` of shape (d0, *rest) becomes
    a tensor of shape (rows, *rest), rows = this rank's share of ceil(d0 / N)-row chunks (may
    be 0), in p's dtype. Names are the original module's. Any ``torch.optim`` optimizer then
    keeps about 1/N of the optimizer state.

    Args:
        module: the module to wrap; its parameters must all be on one device (CPU with gloo,
            CUDA with NCCL).
        process_group: the group to shard over (default: the world group).
        sharding_strategy: a ShardingStrategy or its name (default FULL_SHARD).
        cpu_offload: CPUOffload or bool.
        auto_wrap_policy: a policy from ``fullshard.wrap`` (or a set of module classes).
        backward_prefetch: BACKWARD_PRE (default), BACKWARD_POST or None.
        mixed_precision: a MixedPrecision.
        ignored_modules: modules whose parameters are neither sharded nor reduced.
        param_init_fn: initializer for modules on the meta device.
        device_id: a device (or CUDA index) to move the module to before sharding.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: start the next unit's all-gather during the current forward.
        limit_all_gathers: accepted; fullshard never has more than the current unit's and one
            prefetched all-gather in flight.
        use_orig_params: accepted; names and shapes are always the original ones.
        ignored_states: parameters or modules to ignore (like ``ignored_modules``).
        device_mesh: a 1-D DeviceMesh whose group to shard over.

    Raises:
        RuntimeError: no process group is initialized and none is given.
        ValueError: the module is already wrapped, parameters on several devices, an unknown
            strategy name, or conflicting arguments.
        NotImplementedError: an argument whose feature fullshard does not have yet.
        TypeError: an unknown keyword argument.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[C.ProcessGroup] = None,
        sharding_strategy: Union[None, str, ShardingStrategy] = None,
        cpu_offload: Union[None, bool, CPUOffload] = None,
        auto_wrap_policy: Optional[Any] = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Union[None, int, torch.device] = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Optional[Iterable[Any]] = None,
        device_mesh: Optional[Any] = None,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        auto_wrap_policy = _take_deprecated(deprecated, auto_wrap_policy)
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                "module is already a FullyShardedDataParallel; wrap each module once (to change "
                "its settings, build a fresh model and wrap that)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        strategy = parse_sharding_strategy(sharding_strategy)
        _refuse_unbuilt(strategy, cpu_offload, mixed_precision, param_init_fn, device_mesh)
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError(
                f"backward_prefetch must be a fullshard.BackwardPrefetch or None, got "
                f"{backward_prefetch!r}"
            )
        group = _resolve_group(process_group, device_mesh)
        ignored = _ignored_modules(module, ignored_modules, ignored_states)
        if device_id is not None:
            module.to(_as_device(device_id))
        _check_one_device(module, ignored)
        if sync_module_states:
            _broadcast_module(module, group, ignored)
        policy = as_policy(auto_wrap_policy)
        self._fsdp_kwargs: dict[str, Any] = dict(
            process_group=group,
            sharding_strategy=strategy,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
        )
        if policy is not None:
            apply_policy(
                module,
                policy,
                wrap=lambda m: FullyShardedDataParallel(m, ignored_modules=ignored, **self._fsdp_kwargs),
                is_wrapped=lambda m: isinstance(m, FullyShardedDataParallel),
                ignored=ignored,
            )
        self.sharding_strategy = strategy
        self._ignored = ignored
        params = _owned_params(module, ignored)
        shard_group, replicate_group = (
            (None, group) if strategy is ShardingStrategy.NO_SHARD else (group, None)
        )
        if C.group_size(group) == 1:
            shard_group, replicate_group = None, None
        unit = Unit(
            type(module).__name__,
            params,
            shard_group,
            replicate_group,
            reshard_after_forward=strategy is ShardingStrategy.FULL_SHARD,
        )
        self._hooks = H.UnitHooks(unit)
        self._backward_prefetch = backward_prefetch
        self._forward_prefetch = forward_prefetch
        self._is_root: Optional[bool] = None
        self.add_module(WRAPPED, module)

    # ------------------------------------------------------------------ structure
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._modules[WRAPPED]  # type: ignore[return-value]

    @property
    def unit(self) -> Unit:
        """This instance's FSDP unit (the parameters it owns)."""
        return self._hooks.unit

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__["_modules"].get(WRAPPED)
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key: Any) -> Any:
        return self.module.__getitem__(key)  # type: ignore[operator]

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every FullyShardedDataParallel in ``module``'s tree (only the outermost if root_only)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            inner = {id(x) for m in found for x in m.modules() if x is not m}
            found = [m for m in found if id(m) not in inner]
        return found

    def _lazy_init(self) -> None:
        if self._is_root is not None:
            return
        tree = self.fsdp_modules(self)
        units = [m.unit for m in tree]
        root = H.RootState(units, self._backward_prefetch, self._forward_prefetch)
        for m in tree:
            m._is_root = m is self
            m._hooks.is_root = m is self
            m._hooks.root = root
            m.unit.on_grad_ready = lambda u, r=root: H.post_backward(u, r)

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        if self._is_root:
            args, kwargs = H.move_to_device((args, kwargs), self.unit.device)
        H.pre_forward(self._hooks)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            # Leave the unit usable: shards back in place, full parameters freed, IDLE.
            self.unit.reshard()
            self.unit.training_state = TrainingState.IDLE
            raise
        return H.post_forward(self._hooks, output)

    # ------------------------------------------------------------------ names
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Like nn.Module's, with the original module's names (no wrapper prefixes)."""
        for name, p in super().named_parameters(*args, **kwargs):
            yield clean_name(name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Like nn.Module's, with the original module's names (no wrapper prefixes)."""
        for name, b in super().named_buffers(*args, **kwargs):
            yield clean_name(name), b

    # ------------------------------------------------------------------ state dict
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:  # type: ignore[override]
        """The full (unsharded) state dict, keyed by the original names.

        Gathers one unit at a time; each value is a fresh tensor of the original shape, dtype
        and device, that the unwrapped module loads with ``strict=True``.
        """
        if args:
            raise TypeError("state_dict takes keyword arguments only: destination=, prefix=")
        out = SD.full_state_dict(self, self._ignored)
        if destination is None:
            destination = type(out)()
        for k, v in out.items():
            destination[prefix + k] = v
        return destination

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a full state dict (original names, full shapes); each rank keeps its shards.

        Raises:
            RuntimeError: with ``strict``, missing or unexpected keys; any shape mismatch. Nothing
                is copied unless every entry fits.
        """
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported by fullshard")
        return SD.load_full_state_dict(self, state_dict, strict, self._ignored)

    # ------------------------------------------------------------------ gradient accumulation
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded) without communication inside the context.

        The first backward after the context reduces the accumulated sum.

        Raises:
            RuntimeError: called on a unit that is not the root.
        """
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("no_sync() must be called on the root FullyShardedDataParallel")
        root = self._hooks.root
        assert root is not None
        previous = root.sync_grads
        root.sync_grads = False
        try:
            yield
        finally:
            root.sync_grads = previous

    def training_states(self) -> list[TrainingState]:
        """The training state of every unit in this tree (all IDLE between steps)."""
        return [m.unit.training_state for m in self.fsdp_modules(self)]


FSDP = FullyShardedDataParallel


# ---------------------------------------------------------------------- construction helpers
def _take_deprecated(deprecated: dict[str, Any], auto_wrap_policy: Any) -> Any:
    if "fsdp_auto_wrap_policy" in deprecated:
        warnings.warn(
            "fsdp_auto_wrap_policy is deprecated; use auto_wrap_policy", FutureWarning, stacklevel=3
        )
        if auto_wrap_policy is not None:
            raise ValueError("pass auto_wrap_policy or fsdp_auto_wrap_policy, not both")
        auto_wrap_policy = deprecated.pop("fsdp_auto_wrap_policy")
    if deprecated:
        raise TypeError(
            f"FullyShardedDataParallel got unexpected keyword argument(s) {sorted(deprecated)}"
        )
    return auto_wrap_policy


def _refuse_unbuilt(
    strategy: ShardingStrategy,
    cpu_offload: Any,
    mixed_precision: Any,
    param_init_fn: Any,
    device_mesh: Any,
) -> None:
    if strategy in _HYBRID:
        raise NotImplementedError(f"sharding_strategy={strategy.name} is not built yet in fullshard")
    if mixed_precision is not None:
        raise NotImplementedError("mixed_precision is not built yet in fullshard; pass None")
    offload = cpu_offload.offload_params if isinstance(cpu_offload, CPUOffload) else bool(cpu_offload)
    if offload:
        raise NotImplementedError("cpu_offload with offload_params=True is not built yet in fullshard")
    if param_init_fn is not None:
        raise NotImplementedError("param_init_fn (meta-device initialization) is not built yet")
    if device_mesh is not None and getattr(device_mesh, "ndim", 1) != 1:
        raise NotImplementedError("a device_mesh of more than one dimension (hybrid) is not built yet")


def _resolve_group(process_group: Any, device_mesh: Any) -> C.ProcessGroup:
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("pass process_group or device_mesh, not both")
        return device_mesh.get_group()
    if isinstance(process_group, tuple):
        raise NotImplementedError("a (shard_group, replicate_group) tuple (hybrid) is not built yet")
    if process_group is not None:
        return process_group
    return C.default_group()


def _as_device(device_id: Union[int, torch.device]) -> torch.device:
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    return torch.device(device_id)


def _ignored_modules(
    module: nn.Module, ignored_modules: Optional[Iterable[nn.Module]], ignored_states: Optional[Iterable[Any]]
) -> set[nn.Module]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("pass ignored_modules or ignored_states, not both")
    chosen = list(ignored_modules or []) + list(ignored_states or [])
    out: set[nn.Module] = set()
    for m in chosen:
        if isinstance(m, nn.Parameter):
            raise NotImplementedError(
                "ignored_states with parameters is not built yet; pass the modules that own them"
            )
        if not isinstance(m, nn.Module):
            raise TypeError(f"ignored_modules must hold nn.Module objects, got {type(m).__name__}")
        if isinstance(m, FullyShardedDataParallel):
            raise ValueError("ignored_modules must not contain FullyShardedDataParallel modules")
        out.update(m.modules())
    return out


def _walk_unwrapped(module: nn.Module, ignored: set[nn.Module], prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) for ``module``'s tree, stopping at nested FSDP and ignored modules."""
    yield prefix, module
    for name, child in module.named_children():
        if isinstance(child, FullyShardedDataParallel) or child in ignored:
            continue
        yield from _walk_unwrapped(child, ignored, f"{prefix}{name}.")


def _check_one_device(module: nn.Module, ignored: set[nn.Module]) -> None:
    devices: dict[torch.device, str] = {}
    for prefix, m in _walk_unwrapped(module, ignored):
        for name, p in m._parameters.items():
            if p is not None and not is_sharded(p):
                devices.setdefault(p.device, prefix + name)
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ValueError(
            f"module has parameters on more than one device ({listing}); move it to one device "
            "first (module.to(device)) or pass device_id="
        )
    if torch.device("meta") in devices:
        raise NotImplementedError(
            "module has parameters on the meta device; meta-device initialization "
            "(param_init_fn / reset_parameters) is not built yet: build it on a real device"
        )


def _owned_params(
    module: nn.Module, ignored: set[nn.Module]
) -> list[tuple[str, nn.Parameter, list[ParamSlot]]]:
    owned: dict[int, tuple[str, nn.Parameter, list[ParamSlot]]] = {}
    for prefix, m in _walk_unwrapped(module, ignored):
        for name, p in m._parameters.items():
            if p is None:
                continue
            if is_sharded(p):
                raise ValueError(
                    f"parameter {prefix}{name} is shared with a module that is already a nested "
                    "FSDP unit; wrap the modules that share it inside one unit (e.g. leave their "
                    "common parent unwrapped by the policy)"
                )
            entry = owned.setdefault(id(p), (prefix + name, p, []))
            entry[2].append(ParamSlot(m, name))
    return list(owned.values())


def _broadcast_module(module: nn.Module, group: C.ProcessGroup, ignored: set[nn.Module]) -> None:
    with torch.no_grad():
        for _, m in _walk_unwrapped(module, ignored):
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None and not is_sharded(t):
                    flat = t.detach().reshape(-1).contiguous()
                    C.broadcast(flat, 0, group)
                    t.detach().copy_(flat.view_as(t))
