"""``FullyShardedDataParallel``: torch FSDP1's wrapper API on fullshard's engine.

Each instance wraps one module and owns one unit: the parameters of that module that no nested
``FullyShardedDataParallel`` owns. ``auto_wrap_policy`` creates the nested instances bottom-up.
The outermost instance to run forward becomes the root and coordinates the tree.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine import build, hooks
from fullshard.engine.config import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fullshard.engine.module_wrapper import FSDP_WRAPPED as WRAPPED
from fullshard.engine.module_wrapper import ModuleWrapper
from fullshard.engine.unit import TrainingState, Unit
from fullshard.frontend.clip_grad import clip_grad_norm_
from fullshard.frontend.options import (
    as_backward_prefetch,
    as_cpu_offload,
    as_mixed_precision,
    as_optim_state_dict_config,
    as_state_dict_config,
    as_state_dict_type,
    parse_sharding_strategy,
)
from fullshard.frontend.wrap import apply_policy, as_policy
from fullshard.state import optim_legacy, optim_state
from fullshard.state.state_dict import (
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    local_state_dict,
    sharded_state_dict,
)

if TYPE_CHECKING:  # torch's option types, accepted as well as fullshard's
    from torch.distributed import fsdp as torch_fsdp


class FullyShardedDataParallel(ModuleWrapper):
    """Shard a module's parameters, gradients and optimizer state across a process group.

    Same constructor as ``torch.distributed.fsdp.FullyShardedDataParallel``. After wrapping,
    ``parameters()`` yields this rank's shards: parameter ``p`` of shape (d0, *rest) becomes
    a tensor of shape (rows, *rest), rows = this rank's share of ceil(d0 / N)-row chunks (may
    be 0), in p's dtype. Names are the original module's. Any ``torch.optim`` optimizer then
    keeps about 1/N of the optimizer state.

    The options ``ShardingStrategy``, ``CPUOffload``, ``BackwardPrefetch`` and ``MixedPrecision``
    may be torch's (``torch.distributed.fsdp``) as well as fullshard's: a program that switched
    only its imports keeps working. They are translated by member name and field values (see
    ``fullshard.api``).

    Args:
        module: the module to wrap; its parameters must all be on one device (CPU with gloo,
            CUDA with NCCL).
        process_group: the group to shard over (default: the world group).
        sharding_strategy: a ShardingStrategy or its name (default FULL_SHARD).
        cpu_offload: CPUOffload or bool.
        auto_wrap_policy: a policy from ``fullshard.wrap`` or torch's (or a set of module classes).
        backward_prefetch: BACKWARD_PRE (default), BACKWARD_POST or None.
        mixed_precision: a MixedPrecision, or a dtype (torch.bfloat16) for all three dtypes.
        ignored_modules: modules whose parameters are neither sharded nor reduced.
        param_init_fn: initializer for modules on the meta device.
        device_id: a device (or CUDA index) to move the module to before sharding.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: start the next unit's all-gather during the current forward.
        limit_all_gathers: accepted; fullshard never has more than the current unit's and one
            prefetched all-gather in flight.
        use_orig_params: accepted; names and shapes are always the original ones, and the
            original Parameter objects stay registered (their ``.data`` becomes this rank's
            shard), so an optimizer built before wrapping trains the model.
        ignored_states: parameters or modules to ignore (like ``ignored_modules``).
        device_mesh: a 1-D DeviceMesh whose group to shard over.

    Raises:
        RuntimeError: no process group is initialized and none is given.
        ValueError: the module is already wrapped (by fullshard, or by torch's
            FullyShardedDataParallel or fully_shard anywhere in its tree), contains a module
            given to fullshard's ``fully_shard``, has parameters on several devices, an unknown
            strategy name, or conflicting arguments.
        NotImplementedError: an argument whose feature fullshard does not have yet.
        TypeError: an unknown keyword argument; an option of a type neither fullshard's nor torch's.
    """

    wrapped_key = WRAPPED

    def __init__(
        self,
        module: nn.Module,
        process_group: collectives.ProcessGroup | None = None,
        sharding_strategy: None | str | ShardingStrategy | torch_fsdp.ShardingStrategy = None,
        cpu_offload: None | bool | CPUOffload | torch_fsdp.CPUOffload = None,
        auto_wrap_policy: Any | None = None,
        backward_prefetch: BackwardPrefetch | torch_fsdp.BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: None | torch.dtype | MixedPrecision | torch_fsdp.MixedPrecision = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: None | int | torch.device = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: Any | None = None,
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
        build.check_not_sharded_elsewhere(module, "FullyShardedDataParallel")
        strategy = parse_sharding_strategy(sharding_strategy)
        mp_policy = as_mixed_precision(mixed_precision)
        offload = as_cpu_offload(cpu_offload)
        prefetch = as_backward_prefetch(backward_prefetch)
        groups = build.resolve_groups(process_group, device_mesh, strategy)
        ignored = build.ignored_modules(module, ignored_modules, ignored_states)
        prepared = build.prepare(module, device_id, offload.offload_params, ignored)
        policy = as_policy(auto_wrap_policy)
        self._fsdp_kwargs: dict[str, Any] = dict(
            process_group=groups.given,
            sharding_strategy=strategy,
            backward_prefetch=prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            mixed_precision=mp_policy,
            cpu_offload=offload,
            device_id=prepared.device,
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
        )
        if policy is not None:
            holders = build.param_holders(module)
            apply_policy(
                module,
                policy,
                wrap=lambda m: FullyShardedDataParallel(
                    m, ignored_modules=ignored, _exclude_params=build.shared_outside(m, holders), **self._fsdp_kwargs
                ),
                is_wrapped=lambda m: isinstance(m, FullyShardedDataParallel),
                ignored=ignored,
            )
        self.sharding_strategy = strategy
        self._ignored = ignored
        reshard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        config = build.unit_config(prepared.device, reshard, mp_policy, offload.offload_params, keep_param_objects=True)
        buffer_dtype = mp_policy.buffer_dtype if mp_policy else None
        unit = build.build_unit(
            module, prepared, groups, config, exclude, param_init_fn, sync_module_states, buffer_dtype
        )
        self.mixed_precision = mp_policy
        self.cpu_offload = offload
        hooks.set_fsdp_state(
            self,
            hooks.UnitHooks(
                unit, mixed_precision=mp_policy, backward_prefetch=prefetch, forward_prefetch=forward_prefetch
            ),
        )
        self.add_module(WRAPPED, module)

    # ------------------------------------------------------------------ structure
    @property
    def _hook_state(self) -> hooks.UnitHooks:
        state = hooks.fsdp_state(self)
        assert state is not None, "a FullyShardedDataParallel always heads a unit"
        return state

    @property
    def unit(self) -> Unit:
        """This instance's FSDP unit (the parameters it owns)."""
        return self._hook_state.unit

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FullyShardedDataParallel in ``module``'s tree (only the outermost if root_only)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            inner = {id(x) for m in found for x in m.modules() if x is not m}
            found = [m for m in found if id(m) not in inner]
        return found

    def _lazy_init(self) -> None:
        hooks.lazy_init(self)

    @property
    def _is_root(self) -> bool:
        return self._hook_state.is_root

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        args, kwargs = hooks.prepare_inputs(self._hook_state, (args, kwargs))
        hooks.pre_forward(self._hook_state)
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
        return hooks.post_forward(self._hook_state, output)

    # ------------------------------------------------------------------ state dict
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:  # type: ignore[override]
        """The state dict under the original names, of the type set by ``state_dict_type``.

        FULL_STATE_DICT (the default): full tensors, gathered one unit at a time, that the
        unwrapped module loads with ``strict=True`` (only on rank 0 with ``rank0_only``).
        SHARDED_STATE_DICT: DTensor shards. LOCAL_STATE_DICT: this rank's shards. Collective.
        """
        if args:
            raise TypeError("state_dict takes keyword arguments only: destination=, prefix=")
        settings = self._settings()
        offload = settings.state_dict_config.offload_to_cpu
        if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            out = sharded_state_dict(self, self._ignored)
        elif settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            out = local_state_dict(self, self._ignored, offload)
        else:
            rank0_only = bool(getattr(settings.state_dict_config, "rank0_only", False))
            out = full_state_dict(self, self._ignored, rank0_only, offload)
        if destination is None:
            destination = type(out)()
        for k, v in out.items():
            destination[prefix + k] = v
        return destination

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a state dict of the type set by ``state_dict_type`` (full by default).

        A full state dict holds original names and full shapes, and every rank passes it; each
        keeps its rows. Sharded ones hold DTensors, local ones this rank's shards.

        Raises:
            RuntimeError: with ``strict``, missing or unexpected keys; any shape mismatch. Nothing
                is copied unless every entry fits.
        """
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported by fullshard")
        kind = self._settings().state_dict_type
        if kind is StateDictType.SHARDED_STATE_DICT:
            return load_sharded_state_dict(self, state_dict, strict, self._ignored)
        shards = set(state_dict) if kind is StateDictType.LOCAL_STATE_DICT else ()
        return load_full_state_dict(self, state_dict, strict, self._ignored, shards=shards)

    # ------------------------------------------------------------------ state-dict types
    def _settings(self) -> StateDictSettings:
        return self.__dict__.get("_sd_settings") or StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType | torch_fsdp.StateDictType,
        state_dict_config: StateDictConfig | torch_fsdp.StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | torch_fsdp.OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type (and configs) of every FSDP module in ``module``; returns the old one.

        Args:
            module: an FSDP module, or a module containing FSDP modules.
            state_dict_type: a StateDictType, fullshard's or torch's.
            state_dict_config: a StateDictConfig (fullshard's or torch's; default: the type's own).
            optim_state_dict_config: an OptimStateDictConfig (fullshard's or torch's; default:
                full, or sharded under SHARDED_STATE_DICT).

        Returns:
            the settings in force before, in fullshard's types.

        Raises:
            TypeError: an argument of a type neither fullshard's nor torch's.
        """
        state_dict_type = as_state_dict_type(state_dict_type)
        state_dict_config = as_state_dict_config(state_dict_config)
        optim_state_dict_config = as_optim_state_dict_config(optim_state_dict_config)
        sharded = state_dict_type is StateDictType.SHARDED_STATE_DICT
        new = StateDictSettings(
            state_dict_type,
            state_dict_config
            or (FullStateDictConfig() if state_dict_type is StateDictType.FULL_STATE_DICT else StateDictConfig()),
            optim_state_dict_config or (ShardedOptimStateDictConfig() if sharded else FullOptimStateDictConfig()),
        )
        modules = FullyShardedDataParallel.fsdp_modules(module)
        old = modules[0]._settings() if modules else new
        for m in modules:
            m.__dict__["_sd_settings"] = new
        return old

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType | torch_fsdp.StateDictType,
        state_dict_config: StateDictConfig | torch_fsdp.StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | torch_fsdp.OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """Inside the context, ``state_dict()`` and the optimizer state dicts are of this type.

        Takes the arguments of :meth:`set_state_dict_type` (fullshard's types or torch's).

        Raises:
            TypeError: an argument of a type neither fullshard's nor torch's.
        """
        old = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module, old.state_dict_type, old.state_dict_config, old.optim_state_dict_config
            )

    @staticmethod
    def optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Any = None, group: Any = None
    ) -> dict[str, Any]:
        """The optimizer's state keyed by original parameter names (collective).

        Full tensors by default; DTensor shards under SHARDED_STATE_DICT. Format:
        ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``.
        """
        assert isinstance(model, FullyShardedDataParallel)
        settings = model._settings()
        if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            return optim_state.sharded_optim_state_dict(model, optim)
        osd = optim_state.full_optim_state_dict(model, optim)
        if (
            getattr(settings.optim_state_dict_config, "rank0_only", False)
            and collectives.group_rank(collectives.default_group()) != 0
        ):
            return {"state": {}, "param_groups": osd["param_groups"]}
        return osd

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        """Turn a name-keyed optimizer state dict (full or sharded) into one for ``optim.load_state_dict``.

        Raises:
            KeyError: ``optim_state_dict`` lacks a parameter of ``optim``; names it.
        """
        assert isinstance(model, FullyShardedDataParallel)
        return optim_state.to_load(model, optim, optim_state_dict)

    # torch FSDP1's older optimizer-state functions (deprecated there as here); see _optim_legacy.
    full_optim_state_dict = staticmethod(optim_legacy.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_legacy.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_legacy.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_legacy.scatter_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_legacy.flatten_sharded_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_legacy.rekey_optim_state_dict)

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
        units = [m.unit for m in self.fsdp_modules(self)]
        previous = [u.sync_grads for u in units]
        for u in units:
            u.sync_grads = False
        try:
            yield
        finally:
            for u, before in zip(units, previous):
                u.sync_grads = before

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


def _summon(unit: Unit, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> list[torch.Tensor] | None:
    """Gather ``unit``'s parameters in full precision and register them; None where skipped."""
    full = unit.gather_full(unit.local_flat)
    grads = unit.gather_full(unit.local_grads()) if with_grads else None  # zeros where None
    if rank0_only and collectives.group_rank(collectives.default_group()) != 0:
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
        warnings.warn("fsdp_auto_wrap_policy is deprecated; use auto_wrap_policy", FutureWarning, stacklevel=3)
        if auto_wrap_policy is not None:
            raise ValueError("pass auto_wrap_policy or fsdp_auto_wrap_policy, not both")
        auto_wrap_policy = deprecated.pop("fsdp_auto_wrap_policy")
    if deprecated:
        raise TypeError(f"FullyShardedDataParallel got unexpected keyword argument(s) {sorted(deprecated)}")
    return auto_wrap_policy
