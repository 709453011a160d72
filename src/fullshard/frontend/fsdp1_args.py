"""``FullyShardedDataParallel``'s constructor arguments, turned once into the engine's WrapperConfig.

The outermost wrapper calls :func:`wrapper_config`: option objects (fullshard's or torch's) go
through :mod:`fullshard.frontend.options`, groups and meshes become the unit's groups, ignored
modules one set. Arguments fullshard accepts but has no use for warn here, once per tree; the
nested wrappers the wrap policy creates take the finished config.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine import build
from fullshard.engine.groups import regroup, resolve_groups
from fullshard.engine.meta_init import is_meta
from fullshard.engine.wrapper_config import WrapperConfig
from fullshard.frontend.meshes import check_mesh
from fullshard.frontend.options import (
    as_backward_prefetch,
    as_comm_quantization,
    as_cpu_offload,
    as_mixed_precision,
    parse_sharding_strategy,
    warn_unused,
)
from fullshard.frontend.wrap import as_policy


def wrapper_config(
    module: nn.Module,
    *,
    process_group: collectives.ProcessGroup | None,
    sharding_strategy: Any,
    cpu_offload: Any,
    auto_wrap_policy: Any,
    backward_prefetch: Any,
    mixed_precision: Any,
    ignored_modules: Iterable[nn.Module] | None,
    param_init_fn: Callable[[nn.Module], None] | None,
    device_id: None | int | torch.device,
    sync_module_states: bool,
    forward_prefetch: bool,
    limit_all_gathers: bool,
    use_orig_params: bool | None,
    ignored_states: Iterable[Any] | None,
    device_mesh: Any,
    comm_quantization: Any = None,
) -> WrapperConfig:
    """The WrapperConfig for ``FullyShardedDataParallel(module, ...)``'s arguments (see its docstring).

    Warns (UserWarning) for ``limit_all_gathers=False``, ``use_orig_params=False`` and a
    ``param_init_fn`` that nothing on the meta device needs (unless ``sync_module_states``, where
    the other ranks may need it): fullshard does not act on them.

    Raises:
        TypeError, ValueError: as ``FullyShardedDataParallel``.
    """
    check_mesh(device_mesh, "FullyShardedDataParallel: device_mesh")
    _check_process_group(process_group)
    _check_device_id(device_id)
    if isinstance(ignored_modules, nn.Module):
        raise TypeError(
            f"FullyShardedDataParallel: ignored_modules must be an iterable of modules, got one "
            f"{type(ignored_modules).__name__}; pass ignored_modules=[module]"
        )
    if isinstance(ignored_states, (nn.Module, torch.Tensor)):
        raise TypeError(
            f"FullyShardedDataParallel: ignored_states must be an iterable of modules or parameters, got one "
            f"{type(ignored_states).__name__}; pass ignored_states=[...]"
        )
    strategy = parse_sharding_strategy(sharding_strategy)
    config = WrapperConfig(
        mixed_precision=as_mixed_precision(mixed_precision),
        cpu_offload=as_cpu_offload(cpu_offload),
        backward_prefetch=as_backward_prefetch(backward_prefetch),
        sharding_strategy=strategy,
        groups=resolve_groups(process_group, device_mesh, strategy),
        ignored=build.ignored_modules(ignored_modules, ignored_states),
        auto_wrap_policy=as_policy(auto_wrap_policy),
        forward_prefetch=forward_prefetch,
        param_init_fn=param_init_fn,
        device_id=device_id,
        sync_module_states=sync_module_states,
        comm_quantization=as_comm_quantization(comm_quantization, "FullyShardedDataParallel"),
    )
    _warn_no_effect(module, config, limit_all_gathers, use_orig_params)
    return config


def _check_process_group(process_group: Any) -> None:
    """Refuse a ``process_group`` that is not a ProcessGroup (or, for hybrid sharding, a pair of
    them), and one that leaves this rank out (raised on that rank only).

    Raises:
        TypeError: another type.
        ValueError: this rank is not in the group.
    """
    if process_group is None:
        return
    groups = process_group if isinstance(process_group, tuple) else (process_group,)
    for group in groups:
        if collectives.is_outside(group):
            rank = collectives.group_rank(collectives.default_group())
            raise ValueError(
                f"FullyShardedDataParallel: this rank ({rank}) is not in process_group "
                "(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here): construct FSDP only on "
                "the group's ranks"
            )
        if not collectives.is_group(group):
            raise TypeError(
                "FullyShardedDataParallel: process_group must be a torch.distributed ProcessGroup (for "
                f"HYBRID_SHARD, a tuple (shard group, replicate group)), got {type(group).__name__} {group!r}; "
                "pass torch.distributed.group.WORLD, torch.distributed.new_group(ranks) or None (the world)"
            )


def _check_device_id(device_id: Any) -> None:
    """Refuse a ``device_id`` naming a device this build cannot compute on (CUDA without CUDA, meta).

    Raises:
        ValueError: naming the device and what to pass instead.
    """
    if device_id is None or isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        return  # None, or a type WrapperConfig refuses with its own message
    try:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"FullyShardedDataParallel: device_id={device_id!r} is not a device ({e})") from None
    if device.type == "meta":
        raise ValueError(
            "FullyShardedDataParallel: device_id=meta cannot hold the shards; pass the device to compute on "
            "(a module built on meta is materialized there: keep device_id for that device)"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"FullyShardedDataParallel: device_id={device_id!r} is a CUDA device, but this torch has no CUDA "
            "device available; on CPU pass device_id=None (or torch.device('cpu'))"
        )


def _warn_no_effect(module: nn.Module, config: WrapperConfig, limit_all_gathers: Any, use_orig_params: Any) -> None:
    """Warn for the arguments that ask for something fullshard does not do."""
    if limit_all_gathers is not True:
        warn_unused(
            f"limit_all_gathers={limit_all_gathers!r}",
            "fullshard always limits all-gathers (at most the current unit's and one prefetched one are in flight)",
            4,
        )
    if use_orig_params is not None and use_orig_params is not True:
        warn_unused(
            f"use_orig_params={use_orig_params!r}",
            "fullshard always keeps the original parameters registered (names, shapes and Parameter objects, "
            "as torch's use_orig_params=True) and has no FlatParameter",
            4,
        )
    # Under sync_module_states only some ranks may build on meta (Accelerate's low-memory loading:
    # rank 0 loads the weights, the others take param_init_fn and rank 0's values), as in torch.
    if config.param_init_fn is not None and not config.sync_module_states and not is_meta(module.modules()):
        warn_unused(
            "param_init_fn",
            "no parameter or buffer of the module is on the meta device, and param_init_fn only "
            "initializes those (as torch's); build the model under torch.device('meta') to use it",
            4,
        )


def take_deprecated(deprecated: dict[str, Any], auto_wrap_policy: Any) -> Any:
    """``auto_wrap_policy``, or the deprecated ``fsdp_auto_wrap_policy`` (FutureWarning).

    Raises:
        ValueError: both given.
        TypeError: any other keyword left in ``deprecated``.
    """
    if "fsdp_auto_wrap_policy" in deprecated:
        warnings.warn("fsdp_auto_wrap_policy is deprecated; use auto_wrap_policy", FutureWarning, stacklevel=3)
        if auto_wrap_policy is not None:
            raise ValueError("pass auto_wrap_policy or fsdp_auto_wrap_policy, not both")
        auto_wrap_policy = deprecated.pop("fsdp_auto_wrap_policy")
    if deprecated:
        raise TypeError(f"FullyShardedDataParallel got unexpected keyword argument(s) {sorted(deprecated)}")
    return auto_wrap_policy


OVERRIDABLE = ("sharding_strategy", "mixed_precision", "cpu_offload", "backward_prefetch", "forward_prefetch")
"""The arguments a ``CustomPolicy`` may give one unit beyond the root's."""


def with_overrides(config: WrapperConfig, overrides: dict[str, Any], where: str) -> WrapperConfig:
    """``config`` (a nested wrapper's) with the arguments a ``CustomPolicy`` returned for the
    module ``where`` names; each converted as the constructor converts it.

    Raises:
        ValueError: an argument not in :data:`OVERRIDABLE`, or a strategy that cannot share the
            root's ranks (:func:`fullshard.engine.groups.regroup`).
        TypeError: a value of the wrong type, as the constructor would raise.
    """
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(
            f"CustomPolicy returned {unknown} for {where}: a unit's own arguments may be {', '.join(OVERRIDABLE)}"
        )
    changes: dict[str, Any] = {}
    if "sharding_strategy" in overrides:
        strategy = parse_sharding_strategy(overrides["sharding_strategy"])
        changes.update(sharding_strategy=strategy, groups=regroup(config.groups, strategy))
    if "mixed_precision" in overrides:
        changes["mixed_precision"] = as_mixed_precision(overrides["mixed_precision"])
    if "cpu_offload" in overrides:
        changes["cpu_offload"] = as_cpu_offload(overrides["cpu_offload"])
    if "backward_prefetch" in overrides:
        changes["backward_prefetch"] = as_backward_prefetch(overrides["backward_prefetch"])
    if "forward_prefetch" in overrides:
        changes["forward_prefetch"] = overrides["forward_prefetch"]
    return dataclasses.replace(config, **changes)
