"""``FullyShardedDataParallel``: torch FSDP1's wrapper API on fullshard's engine.

Each instance wraps one module and owns one unit: the parameters of that module that no nested
``FullyShardedDataParallel`` owns. ``auto_wrap_policy`` creates the nested instances bottom-up.
The outermost instance to run forward becomes the root and coordinates the tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from fullshard import _collectives as C
from fullshard import _hooks as H
from fullshard import _state_dict as SD
from fullshard._init import is_meta, materialize
from fullshard._module_wrapper import FSDP_WRAPPED as WRAPPED
from fullshard._module_wrapper import ModuleWrapper, clean_name
from fullshard._sharded_param import ParamSlot, is_sharded
from fullshard._unit import TrainingState, Unit, UnitConfig
from fullshard.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    as_cpu_offload,
    as_mixed_precision,
    parse_sharding_strategy,
)
from fullshard.clip_grad import clip_grad_norm_
from fullshard.wrap import apply_policy, as_policy

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class FullyShardedDataParallel(ModuleWrapper):
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
        mixed_precision: a MixedPrecision, or a dtype (torch.bfloat16) for all three dtypes.
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

    wrapped_key = WRAPPED

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[C.ProcessGroup] = None,
        sharding_strategy: Union[None, str, ShardingStrategy] = None,
        cpu_offload: Union[None, bool, CPUOffload] = None,
        auto_wrap_policy: Optional[Any] = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Union[None, torch.dtype, MixedPrecision] = None,
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
        exclude: set[int] = deprecated.pop("_exclude_params", set())
        auto_wrap_policy = _take_deprecated(deprecated, auto_wrap_policy)
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                "module is already a FullyShardedDataParallel; wrap each module once (to change "
                "its settings, build a fresh model and wrap that)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        strategy = parse_sharding_strategy(sharding_strategy)
        mp_policy = as_mixed_precision(mixed_precision)
        offload = as_cpu_offload(cpu_offload)
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError(
                f"backward_prefetch must be a fullshard.BackwardPrefetch or None, got "
                f"{backward_prefetch!r}"
            )
        groups = _resolve_groups(process_group, device_mesh, strategy)
        ignored = _ignored_modules(module, ignored_modules, ignored_states)
        device = _compute_device(module, device_id, offload.offload_params, ignored)
        meta = is_meta(module.modules())
        if not meta:
            _place(module, device, offload.offload_params, ignored)
            _check_one_device(module, ignored)
        policy = as_policy(auto_wrap_policy)
        self._fsdp_kwargs: dict[str, Any] = dict(
            process_group=groups.given,
            sharding_strategy=strategy,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            mixed_precision=mp_policy,
            cpu_offload=offload,
            device_id=device,
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
        )
        if policy is not None:
            holders = _param_holders(module)
            apply_policy(
                module,
                policy,
                wrap=lambda m: FullyShardedDataParallel(
                    m, ignored_modules=ignored, _exclude_params=_shared_outside(m, holders), **self._fsdp_kwargs
                ),
                is_wrapped=lambda m: isinstance(m, FullyShardedDataParallel),
                ignored=ignored,
            )
        self.sharding_strategy = strategy
        self._ignored = ignored
        region = list(_walk_unwrapped(module, ignored))
        params = _owned_params(module, ignored, exclude)
        if meta:  # nested units have materialized theirs; now this unit's own
            named = [(clean_name(n).rstrip("."), m) for n, m in region]
            params = materialize(named, params, device, param_init_fn)
            _place(module, device, offload.offload_params, ignored)
            _check_one_device(module, ignored)
        if sync_module_states:
            for g in groups.broadcast_order:
                _broadcast_module(region, g)
        shard_group, replicate_group = groups.shard, groups.replicate
        config = UnitConfig(
            compute_device=device,
            reshard_after_forward=strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
            param_dtype=mp_policy.param_dtype if mp_policy else None,
            reduce_dtype=mp_policy.reduce_dtype if mp_policy else None,
            keep_low_precision_grads=bool(mp_policy and mp_policy.keep_low_precision_grads),
            offload=offload.offload_params and device.type != "cpu",
        )
        unit = Unit(type(module).__name__, params, shard_group, replicate_group, config)
        if mp_policy is not None and mp_policy.buffer_dtype is not None:
            _cast_buffers(module, mp_policy.buffer_dtype, ignored)
        self.mixed_precision = mp_policy
        self.cpu_offload = offload
        self._hooks = H.UnitHooks(unit, mixed_precision=mp_policy)
        self._backward_prefetch = backward_prefetch
        self._forward_prefetch = forward_prefetch
        self._is_root: Optional[bool] = None
        self.add_module(WRAPPED, module)

    # ------------------------------------------------------------------ structure
    @property
    def unit(self) -> Unit:
        """This instance's FSDP unit (the parameters it owns)."""
        return self._hooks.unit

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
        names = {id(m): clean_name(n) or "<root>" for n, m in self.named_modules() if isinstance(m, FullyShardedDataParallel)}
        for m in tree:
            m.unit.name = names[id(m)]
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
        args, kwargs = H.prepare_inputs(self._hooks, (args, kwargs))
        H.pre_forward(self._hooks)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            # A failed forward leaves the unit usable: shards back, full parameters freed, IDLE.
            # A recomputation in backward (activation checkpointing stops it early by raising)
            # must keep the unit gathered for the rest of its backward.
            if self.unit.training_state is TrainingState.FORWARD:
                self.unit.reshard()
                self.unit.training_state = TrainingState.IDLE
            raise
        return H.post_forward(self._hooks, output)

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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every unit in this tree by their total (unsharded) norm.

        Collective: every rank calls it. Returns the total norm before clipping (float32).

        Raises:
            RuntimeError: called on a unit that is not the root.
        """
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError(
                "clip_grad_norm_ must be called on the root FullyShardedDataParallel (the outermost "
                "wrapper): the norm spans every unit's gradients"
            )
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Inside the context, the modules hold full parameters (original shapes and dtypes).

        ``module.weight`` and ``parameters()`` give full tensors. With ``writeback``, changes to
        them are copied into the shards on exit. Collective: every rank enters it.

        Args:
            module: an FSDP module, or a module containing FSDP modules.
            recurse: include nested units (else only ``module``'s own unit).
            writeback: copy changes back to the shards on exit.
            rank0_only: only rank 0 materializes full parameters; other ranks keep shards.
            offload_to_cpu: put the full parameters in CPU memory.
            with_grads: also gather the gradients into the full parameters' ``.grad``.

        Raises:
            ValueError: ``writeback`` together with ``rank0_only``.
            RuntimeError: called during forward or backward.
        """
        if rank0_only and writeback:
            raise ValueError(
                "summon_full_params(writeback=True, rank0_only=True) would lose other ranks' writes; "
                "pass writeback=False with rank0_only=True"
            )
        if recurse or not isinstance(module, FullyShardedDataParallel):
            units = [m.unit for m in FullyShardedDataParallel.fsdp_modules(module)]
        else:
            units = [module.unit]
        for unit in units:
            unit._check_state(TrainingState.IDLE, "summon full parameters")
        summoned = [_summon(unit, rank0_only, offload_to_cpu, with_grads) for unit in units]
        try:
            yield
        finally:
            for unit, full in zip(units, summoned):
                if writeback and full is not None:
                    unit.write_back(full)
                for sp in unit.params:
                    assert sp.shard is not None
                    sp.register_shard(sp.shard)

    def training_states(self) -> list[TrainingState]:
        """The training state of every unit in this tree (all IDLE between steps)."""
        return [m.unit.training_state for m in self.fsdp_modules(self)]


FSDP = FullyShardedDataParallel


def _summon(unit: Unit, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> Optional[list[torch.Tensor]]:
    """Gather ``unit``'s parameters in full precision and register them; None where skipped."""
    full = unit.gather_full(unit.local_flat)
    grads = unit.gather_full(unit.local_grads()) if with_grads else None  # zeros where None
    if rank0_only and C.group_rank(C.default_group()) != 0:
        return None
    if offload_to_cpu:
        full = [t.cpu() for t in full]
        grads = [g.cpu() for g in grads] if grads is not None else None
    for i, (sp, value) in enumerate(zip(unit.params, full)):
        param = nn.Parameter(value, requires_grad=sp.requires_grad)
        assert sp.shard is not None
        if grads is not None and sp.requires_grad and sp.shard.grad is not None:
            param.grad = grads[i]
        sp.swap_registered(param)
    return full


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


@dataclasses.dataclass
class _Groups:
    """The groups a unit shards and replicates over (None: a group of one rank)."""

    given: Any  # what nested units receive as process_group
    shard: Optional[C.ProcessGroup]
    replicate: Optional[C.ProcessGroup]
    broadcast_order: list[C.ProcessGroup]  # sync_module_states: rank 0's values reach every rank


def _resolve_groups(process_group: Any, device_mesh: Any, strategy: ShardingStrategy) -> _Groups:
    """Shard and replicate groups from ``process_group`` / ``device_mesh`` and the strategy.

    Raises:
        ValueError: both given; a mesh or tuple that does not fit the strategy or the world size.
    """
    hybrid = strategy in _HYBRID
    if device_mesh is not None and process_group is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if device_mesh is not None:
        if device_mesh.ndim == 2 and hybrid:
            shard, replicate = device_mesh.get_group(1), device_mesh.get_group(0)
        elif device_mesh.ndim == 1 and not hybrid:
            return _flat(device_mesh.get_group(), strategy)
        else:
            raise ValueError(
                f"device_mesh has {device_mesh.ndim} dimension(s) but sharding_strategy={strategy.name} "
                "needs " + ("2: (replicate, shard), e.g. init_device_mesh('cuda', (2, 4))" if hybrid else "1")
            )
    elif isinstance(process_group, tuple):
        if not hybrid or len(process_group) != 2:
            raise ValueError(
                f"a process_group tuple means (shard_group, replicate_group) for HYBRID_SHARD or "
                f"_HYBRID_SHARD_ZERO2, not {strategy.name}"
            )
        shard, replicate = process_group
    elif hybrid:
        shard, replicate = C.hybrid_groups(C.local_world_size())
    else:
        return _flat(process_group if process_group is not None else C.default_group(), strategy)
    world = C.group_size(C.default_group())
    if C.group_size(shard) * C.group_size(replicate) != world:
        raise ValueError(
            f"the hybrid groups cover {C.group_size(shard)} x {C.group_size(replicate)} ranks but the "
            f"world size is {world}: build the mesh as init_device_mesh(device, (world // shard_size, shard_size))"
        )
    return _Groups(
        given=(shard, replicate),
        shard=shard if C.group_size(shard) > 1 else None,
        replicate=replicate if C.group_size(replicate) > 1 else None,
        broadcast_order=[shard, replicate],
    )


def _flat(group: C.ProcessGroup, strategy: ShardingStrategy) -> _Groups:
    if C.group_size(group) == 1:
        return _Groups(group, None, None, [group])
    if strategy is ShardingStrategy.NO_SHARD:
        return _Groups(group, None, group, [group])
    return _Groups(group, group, None, [group])


def _as_device(device_id: Union[int, str, torch.device]) -> torch.device:
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    device = torch.device(device_id)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_warned_offload_on_cpu = False


def _compute_device(
    module: nn.Module, device_id: Any, offload: bool, ignored: set[nn.Module]
) -> torch.device:
    """Where the unit computes: ``device_id``, else the module's device (a GPU under offload)."""
    global _warned_offload_on_cpu
    current = next(
        (
            t.device
            for _, m in _walk_unwrapped(module, ignored)
            for t in _local_tensors(m)
            if not is_sharded(t) and not t.is_meta
        ),
        None,
    )
    if device_id is not None:
        device = _as_device(device_id)
        if current is not None and current.type == "cuda" and device.type == "cuda" and current != device:
            raise ValueError(
                f"module is on {current} but device_id={device}: move the module to {device} or "
                f"pass device_id={current.index}"
            )
    elif current is not None and current.type != "cpu":
        device = current
    elif offload and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = current or torch.device("cpu")
    if offload and device.type == "cpu" and not _warned_offload_on_cpu:
        _warned_offload_on_cpu = True
        warnings.warn(
            "cpu_offload has no effect on a CPU-only run: the shards already live in CPU memory",
            UserWarning,
            stacklevel=4,
        )
    return device


def _local_tensors(m: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None]


def _place(module: nn.Module, device: torch.device, offload: bool, ignored: set[nn.Module]) -> None:
    """Move the module to ``device``; under offload only its buffers (shards stay on CPU)."""
    if device.type == "cpu":
        return
    if not offload:
        module.to(device)
        return
    for m in ignored:  # modules FSDP leaves alone compute on the device as they are
        m.to(device)
    for _, m in _walk_unwrapped(module, ignored):
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)


def _cast_buffers(module: nn.Module, dtype: torch.dtype, ignored: set[nn.Module]) -> None:
    """Cast floating-point buffers to ``dtype``, remembering the original for state dicts."""
    for _, m in _walk_unwrapped(module, ignored):
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                originals = m.__dict__.setdefault("_fullshard_buffer_dtypes", {})
                originals.setdefault(name, b.dtype)
                m._buffers[name] = b.to(dtype)


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


def _param_holders(module: nn.Module) -> dict[int, set[int]]:
    """id(parameter) -> ids of every module that registers it (tied parameters have several)."""
    holders: dict[int, set[int]] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(m))
    return holders


def _shared_outside(child: nn.Module, holders: dict[int, set[int]]) -> set[int]:
    """Parameters of ``child``'s tree also registered outside it: a common ancestor owns them."""
    inside = {id(m) for m in child.modules()}
    return {id(p) for p in child.parameters() if not holders.get(id(p), set()) <= inside}


def _owned_params(
    module: nn.Module, ignored: set[nn.Module], exclude: set[int]
) -> list[tuple[str, nn.Parameter, list[ParamSlot]]]:
    """The parameters this unit owns: all in ``module``'s tree that no nested unit sharded.

    That includes tied parameters nested units left to this one (with all their slots, nested
    ones too), and leaves out ``exclude`` (parameters shared beyond ``module``).

    Raises:
        ValueError: a parameter sharded by a nested unit is also used outside that unit.
    """
    # An explicit stack, not a recursive closure: a closure cycle would keep the original full
    # parameters alive until the garbage collector runs, long after sharding.
    owned: dict[int, tuple[str, nn.Parameter, list[ParamSlot]]] = {}
    stack: list[tuple[nn.Module, str, bool]] = [(module, "", False)]
    while stack:
        m, prefix, nested = stack.pop()
        for name, p in m._parameters.items():
            if p is None or id(p) in exclude:
                continue
            if hasattr(p, "_fullshard_sharded_as"):
                raise ValueError(
                    f"parameter {clean_name(prefix + name)} is tied to {p._fullshard_sharded_as}, which a "
                    "nested FSDP unit already sharded; wrap the modules that share it inside one unit "
                    "(let one auto_wrap_policy wrap the whole model, which keeps tied parameters in "
                    "their common ancestor)"
                )
            if is_sharded(p):
                if nested:
                    continue  # the nested unit's own parameter
                raise ValueError(
                    f"parameter {clean_name(prefix + name)} is shared with a module that is already a "
                    "nested FSDP unit; wrap the modules that share it inside one unit (let one "
                    "auto_wrap_policy wrap the whole model, which keeps tied parameters in their "
                    "common ancestor)"
                )
            entry = owned.setdefault(id(p), (clean_name(prefix + name), p, []))
            entry[2].append(ParamSlot(m, name))
        children = [(c, f"{prefix}{n}.", nested or isinstance(c, FullyShardedDataParallel)) for n, c in m.named_children()]
        stack.extend(reversed([c for c in children if c[0] not in ignored]))  # keep module order
    return list(owned.values())


def _broadcast_module(region: list[tuple[str, nn.Module]], group: C.ProcessGroup) -> None:
    """Give every rank rank 0's parameters and buffers of one unit's modules (collective)."""
    device = C.reduction_device(group)
    with torch.no_grad():
        for _, m in region:
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None and not is_sharded(t):
                    flat = t.detach().reshape(-1).to(device).contiguous()  # NCCL needs CUDA tensors
                    C.broadcast(flat, 0, group)
                    t.detach().copy_(flat.view_as(t))
