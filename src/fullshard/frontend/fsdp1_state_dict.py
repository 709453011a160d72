"""FullyShardedDataParallel's state-dict methods: the type in force, model and optimizer state.

``state_dict_type`` / ``set_state_dict_type`` choose, for every wrapper of a tree, what
``state_dict()``, ``load_state_dict()`` and the optimizer-state functions produce and take
(full, sharded or local tensors). The mappings live in :mod:`fullshard.state`, which works from
units; :class:`StateDictMethods`, the wrapper's base class, holds the methods torch's wrapper
has and reads the settings. A config field the chosen type has no use for warns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fullshard.comm import collectives, flight_recorder
from fullshard.engine import hooks
from fullshard.engine.config import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fullshard.engine.inference_guard import outside_inference_mode
from fullshard.engine.module_wrapper import ModuleWrapper
from fullshard.frontend import fsdp1_optim
from fullshard.frontend.options import (
    as_optim_state_dict_config,
    as_optim_state_key_type,
    as_state_dict_config,
    as_state_dict_type,
    warn_unused,
)
from fullshard.state import optim_legacy
from fullshard.state.state_dict import (
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    local_state_dict,
    sharded_state_dict,
)

if TYPE_CHECKING:  # torch's option types, accepted as well as fullshard's
    from torch.distributed import fsdp as torch_fsdp

_SETTINGS = "_sd_settings"  # where each wrapper keeps its StateDictSettings (in its __dict__)


class StateDictMethods(ModuleWrapper):
    """The state-dict methods of ``FullyShardedDataParallel`` (its base class)."""

    @property
    def _unit_state(self) -> hooks.FSDPState:
        state = hooks.fsdp_state(self)
        assert state is not None, "a FullyShardedDataParallel always heads a unit"
        return state

    @flight_recorder.labelled("state_dict")
    @outside_inference_mode
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:  # type: ignore[override]
        """The state dict under the original names, of the type set by ``state_dict_type``.

        FULL_STATE_DICT (the default): full tensors, gathered one unit at a time, that the
        unwrapped module loads with ``strict=True`` (only on rank 0 with ``rank0_only``).
        SHARDED_STATE_DICT: DTensor shards. LOCAL_STATE_DICT: this rank's shards. Collective.
        ``keep_vars=True`` warns: the values are always detached tensors.

        Raises:
            TypeError: a positional argument.
        """
        if args:
            raise TypeError("state_dict takes keyword arguments only: destination=, prefix=")
        if keep_vars:
            warn_unused("state_dict(keep_vars=True)", "FSDP state dicts hold detached tensors, never Parameters", 2)
        settings = self._settings()
        offload = settings.state_dict_config.offload_to_cpu
        ignored = self._unit_state.ignored
        if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            fsdp1_optim.warn_sharded_offload(self, offload, "state_dict_config", stacklevel=2)
            out = sharded_state_dict(self, ignored)
        elif settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            out = local_state_dict(self, ignored, offload)
        else:
            rank0_only = bool(getattr(settings.state_dict_config, "rank0_only", False))
            out = full_state_dict(self, ignored, rank0_only, offload)
        if destination is None:
            destination = type(out)()
        for k, v in out.items():
            destination[prefix + k] = v
        return destination

    @flight_recorder.labelled("load_state_dict")
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a state dict of the type set by ``state_dict_type`` (full by default).

        A full state dict holds original names and full shapes, and every rank passes it; each
        keeps its rows. Sharded ones hold DTensors, local ones this rank's shards.

        Raises:
            RuntimeError: with ``strict``, missing or unexpected keys; any shape mismatch. Nothing
                is copied unless every entry fits.
            NotImplementedError: ``assign=True``.
        """
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported by fullshard")
        kind = self._settings().state_dict_type
        ignored = self._unit_state.ignored
        if kind is StateDictType.SHARDED_STATE_DICT:
            return load_sharded_state_dict(self, state_dict, strict, ignored)
        if kind is not StateDictType.LOCAL_STATE_DICT:
            return load_full_state_dict(self, state_dict, strict, ignored, shards=())
        try:
            return load_full_state_dict(self, state_dict, strict, ignored, shards=set(state_dict))
        except RuntimeError as e:
            if "size mismatch" not in str(e):
                raise
            raise RuntimeError(
                f"{e}\n\tA LOCAL_STATE_DICT holds one rank's shards as they were at the world size that saved it: "
                "load it at that world size, or save a SHARDED_STATE_DICT or FULL_STATE_DICT to load at another"
            ) from None

    def _settings(self) -> StateDictSettings:
        return self.__dict__.get(_SETTINGS) or StateDictSettings(
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
        full = state_dict_type is StateDictType.FULL_STATE_DICT
        sharded = state_dict_type is StateDictType.SHARDED_STATE_DICT
        new = StateDictSettings(
            state_dict_type,
            state_dict_config or (FullStateDictConfig() if full else StateDictConfig()),
            optim_state_dict_config or (ShardedOptimStateDictConfig() if sharded else FullOptimStateDictConfig()),
        )
        _warn_rank0_only(new)
        modules = wrappers(module)
        old = modules[0]._settings() if modules else new
        for m in modules:
            m.__dict__[_SETTINGS] = new
        return old

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of the FSDP modules in ``module``'s tree (torch's
        ``FSDP.get_state_dict_type``); ``module`` need not be one itself.

        Raises:
            ValueError: ``module``'s tree holds no FullyShardedDataParallel.
            RuntimeError: its FSDP modules have different settings (``set_state_dict_type`` was
                called on a submodule).
        """
        modules = wrappers(module)
        if not modules:
            raise ValueError(f"get_state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel module")
        settings = modules[0]._settings()
        if any(m._settings() != settings for m in modules[1:]):
            raise RuntimeError(
                "get_state_dict_type: the FSDP modules have different state-dict settings: call "
                "set_state_dict_type on the root, which sets every module under it"
            )
        return settings

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
        old = StateDictMethods.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            StateDictMethods.set_state_dict_type(
                module, old.state_dict_type, old.state_dict_config, old.optim_state_dict_config
            )

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: collectives.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The optimizer's state keyed by original parameter names (collective).

        Full tensors by default; DTensor shards under SHARDED_STATE_DICT. Format:
        ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``; with
        ``FullOptimStateDictConfig(rank0_only=True)``, ``{}`` on the other ranks (as torch's).

        Args:
            model: the root module whose parameters ``optim`` updates: a FullyShardedDataParallel,
                or (as torch's) a module holding them.
            optim: the optimizer over ``model``'s shards.
            optim_state_dict: ``optim.state_dict()`` (or another state dict of ``optim``'s
                layout) to convert instead of ``optim``'s current state (default: ``optim``'s).
            group: under ``rank0_only``, the group whose rank 0 receives the dict (default: the
                world); otherwise not used (each unit gathers over its own group), and warns.

        Raises:
            TypeError: ``model`` holds no FullyShardedDataParallel, ``optim`` is not an optimizer,
                or ``optim_state_dict`` not an optimizer state dict.
            ValueError: ``optim_state_dict`` names a parameter id ``optim`` does not have.
        """
        settings = _root(model, "optim_state_dict")._settings()
        with flight_recorder.at(phase="optim_state_dict"):
            return fsdp1_optim.save(model, settings, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None,
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: collectives.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Turn a name-keyed optimizer state dict (full or sharded) into one for ``optim.load_state_dict``.

        Args:
            model: the root module whose parameters ``optim`` updates: a FullyShardedDataParallel,
                or (as torch's) a module holding them.
            optim: the optimizer that will load the result.
            optim_state_dict: what :meth:`optim_state_dict` returned (any world size for full
                ones). Under FULL_STATE_DICT with ``rank0_only`` only rank 0 of ``group`` needs
                it (the others may pass None): rank 0 sends each rank its rows (collective).
            is_named_optimizer: torch's NamedOptimizer / KeyedOptimizer; not supported, warns.
            load_directly: also call ``optim.load_state_dict`` on the result.
            group: under ``rank0_only``, the group rank 0 sends over (default: the world);
                otherwise not used, and warns.

        Returns:
            ``{"state": {id: {key: value}}, "param_groups": [...]}`` with this rank's rows.

        Raises:
            TypeError: ``model`` holds no FullyShardedDataParallel, ``optim`` is not an optimizer,
                or ``optim_state_dict`` not an optimizer state dict.
            KeyError: ``optim_state_dict`` lacks a parameter of ``optim``; names it.
        """
        settings = _root(model, "optim_state_dict_to_load")._settings()
        if is_named_optimizer:
            warn_unused(
                "optim_state_dict_to_load(is_named_optimizer=True)",
                "fullshard returns the id-keyed dict torch.optim.Optimizer.load_state_dict takes",
                2,
            )
        result = fsdp1_optim.to_load(model, settings, optim, optim_state_dict, group)
        if load_directly:
            optim.load_state_dict(result)
        return result

    # torch FSDP1's older optimizer-state functions (deprecated there as here); see optim_legacy.
    full_optim_state_dict = staticmethod(optim_legacy.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_legacy.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_legacy.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_legacy.scatter_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_legacy.flatten_sharded_optim_state_dict)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any], optim_state_key_type: Any, model: nn.Module, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """torch FSDP1's ``rekey_optim_state_dict`` (see ``fullshard.state.optim_keys``); takes
        fullshard's or torch's ``OptimStateKeyType``."""
        key_type = as_optim_state_key_type(optim_state_key_type)
        return optim_legacy.rekey_optim_state_dict(optim_state_dict, key_type, model, *args, **kwargs)


_PENDING = "_fullshard_load_keys"  # on a wrapper between its load hooks: (prefix, missing, unexpected)


def register_load_hooks(wrapper: StateDictMethods) -> None:
    """Let a wrapper load its part when a module above it that is no wrapper loads a state dict.

    ``nn.Module.load_state_dict`` on such a root walks into the wrapper without calling its
    ``load_state_dict``. The pre-hook takes the entries under the wrapper's prefix out of the
    state dict and loads them through :meth:`StateDictMethods.load_state_dict` (its subtree,
    nested wrappers included); the post-hook replaces the keys the walk then reports missing in
    the wrapper's subtree with those that load found missing or unexpected. Errors go to the
    root's error list, so a strict load fails with torch's message. A nested wrapper finds its
    entries gone (the enclosing one loaded them) and does nothing.
    """
    wrapper.register_load_state_dict_pre_hook(_load_part)
    wrapper.register_load_state_dict_post_hook(_report_part)


def _load_part(
    module: nn.Module,
    state_dict: Any,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    keys = [k for k in state_dict if k.startswith(prefix)]
    if not keys:  # an enclosing wrapper loaded this part (or the dict has none: the walk reports it)
        return
    if local_metadata.get("assign_to_params_buffers"):
        error_msgs.append("FullyShardedDataParallel: load_state_dict(assign=True) is not supported by fullshard")
        return
    part = {k[len(prefix) :]: state_dict.pop(k) for k in keys}
    assert isinstance(module, StateDictMethods)
    try:
        result = module.load_state_dict(part, strict=False)
    except RuntimeError as e:
        error_msgs.append(str(e))
        result = None
    missing = [prefix + k for k in result.missing_keys] if result else []
    unexpected = [prefix + k for k in result.unexpected_keys] if result else []
    module.__dict__[_PENDING] = (prefix, missing, unexpected)


def _report_part(module: nn.Module, incompatible_keys: Any) -> None:
    pending = module.__dict__.pop(_PENDING, None)
    if pending is None:
        return
    prefix, missing, unexpected = pending
    for keys, found in ((incompatible_keys.missing_keys, missing), (incompatible_keys.unexpected_keys, unexpected)):
        keys[:] = [k for k in keys if not k.startswith(prefix)] + found


def wrappers(module: nn.Module, root_only: bool = False) -> list[StateDictMethods]:
    """Every FullyShardedDataParallel in ``module``'s tree (``module`` included), in module
    order; with ``root_only``, only those no other of them holds."""
    found = [m for m in module.modules() if isinstance(m, StateDictMethods)]
    if root_only:
        inner = {id(x) for m in found for x in m.modules() if x is not m}
        found = [m for m in found if id(m) not in inner]
    return found


def _root(model: Any, caller: str) -> StateDictMethods:
    """The wrapper whose settings ``caller`` follows: ``model`` itself, or (a root that is not a
    wrapper, as torch's allows) the first wrapper in its tree."""
    found = wrappers(model) if isinstance(model, nn.Module) else []
    if not found:
        raise TypeError(
            f"{caller}: model must be the root module whose parameters the optimizer updates, holding "
            f"FullyShardedDataParallel modules; got {type(model).__name__} with none"
        )
    return found[0]


def _warn_rank0_only(settings: StateDictSettings) -> None:
    """Warn for a ``rank0_only`` that the chosen state-dict type has no use for."""
    kind = settings.state_dict_type
    if kind is not StateDictType.FULL_STATE_DICT and getattr(settings.state_dict_config, "rank0_only", False):
        warn_unused(
            f"state_dict_config.rank0_only=True under {kind.name}",
            "only FULL_STATE_DICT gathers to rank 0; pass that type, or a config of the chosen type",
            3,
        )
    if kind is StateDictType.SHARDED_STATE_DICT and getattr(settings.optim_state_dict_config, "rank0_only", False):
        warn_unused(
            "optim_state_dict_config.rank0_only=True under SHARDED_STATE_DICT",
            "sharded optimizer state dicts give every rank its shards; pass FULL_STATE_DICT to gather to rank 0",
            3,
        )
