"""The FSDP1 wrapper's settings: one frozen, validated object from the root wrapper to the builder.

``FullyShardedDataParallel(module, ...)`` normalizes its arguments (fullshard's or torch's option
objects, strategy names, groups or a mesh, ignored modules) once, at the outermost call, into a
:class:`WrapperConfig` (:func:`fullshard.frontend.fsdp1_args.wrapper_config`). The wrap-policy
recursion hands that same object to every nested wrapper it creates, and
:func:`fullshard.engine.build.build_wrapper_unit` reads it; nothing is parsed twice, and each
setting is read in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fullshard.engine.config import BackwardPrefetch, CommQuantization, CPUOffload, MixedPrecision, ShardingStrategy
from fullshard.engine.groups import Groups

_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


@dataclasses.dataclass(frozen=True)
class WrapperConfig:
    """What every unit of one ``FullyShardedDataParallel`` tree is built with.

    Attributes:
        groups: the shard and replicate groups (from ``process_group`` / ``device_mesh``).
        sharding_strategy: how parameters, gradients and optimizer state are split.
        mixed_precision: the dtypes for compute, reduction and buffers (None: the parameters').
        cpu_offload: whether shards and their gradients live in CPU memory.
        backward_prefetch: when the next unit's all-gather starts in backward (None: never early).
        forward_prefetch: start the next unit's all-gather during the current forward.
        auto_wrap_policy: selects the submodules that become nested wrappers (None: none).
        ignored: the modules (with all their submodules) left unsharded and unreduced.
        param_init_fn: initializes modules on the meta device (None: ``reset_parameters()``).
        device_id: the compute device as given (a device, a CUDA index, or None: the module's);
            the wrappers nested under the root get the device the root chose (see
            :meth:`for_nested`).
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        comm_quantization: gather parameters and/or reduce gradients quantized (None: exactly).

    Raises:
        TypeError: a field of the wrong type, naming the constructor argument it comes from.
    """

    groups: Groups
    sharding_strategy: ShardingStrategy
    mixed_precision: MixedPrecision | None = None
    cpu_offload: CPUOffload = dataclasses.field(default_factory=CPUOffload)
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    auto_wrap_policy: Callable[..., bool] | None = None
    ignored: frozenset[nn.Module] = frozenset()
    param_init_fn: Callable[[nn.Module], None] | None = None
    device_id: int | str | torch.device | None = None
    sync_module_states: bool = False
    comm_quantization: CommQuantization | None = None

    def __post_init__(self) -> None:
        _check(self.groups, Groups, "process_group/device_mesh", "resolve them with engine.groups.resolve_groups")
        _check(self.sharding_strategy, ShardingStrategy, "sharding_strategy", "pass a ShardingStrategy member")
        _check(self.mixed_precision, (MixedPrecision, type(None)), "mixed_precision", "pass a MixedPrecision or None")
        _check(self.cpu_offload, CPUOffload, "cpu_offload", "pass a CPUOffload")
        _check(
            self.comm_quantization,
            (CommQuantization, type(None)),
            "comm_quantization",
            "pass a fullshard.CommQuantization (e.g. CommQuantization(params='int8', grads='bf16')) or None",
        )
        _check(self.backward_prefetch, (BackwardPrefetch, type(None)), "backward_prefetch", "pass one or None")
        for name in ("forward_prefetch", "sync_module_states"):
            _check(getattr(self, name), bool, name, "pass True or False")
        for name in ("auto_wrap_policy", "param_init_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable or None, got {value!r}; pass a function (or None)")
        _check(self.ignored, frozenset, "ignored_modules", "pass an iterable of nn.Module objects")
        if not all(isinstance(m, nn.Module) for m in self.ignored):
            raise TypeError("ignored_modules must hold nn.Module objects only; pass the modules to leave unsharded")
        _check(
            self.device_id,
            (int, str, torch.device, type(None)),
            "device_id",
            "pass a torch.device, a CUDA device index or None",
        )

    @property
    def reshard_after_forward(self) -> bool:
        """Whether the strategy frees the full parameters after forward (FULL_SHARD, HYBRID_SHARD)."""
        return self.sharding_strategy in _RESHARD_AFTER_FORWARD

    @property
    def offload_params(self) -> bool:
        """Whether shards and their gradients live in CPU memory."""
        return self.cpu_offload.offload_params

    @property
    def buffer_dtype(self) -> torch.dtype | None:
        """The dtype buffers are cast to (None: left as they are)."""
        return self.mixed_precision.buffer_dtype if self.mixed_precision is not None else None

    def for_nested(self, device: torch.device) -> WrapperConfig:
        """The config of the wrappers the policy creates under one that computes on ``device``.

        They compute on the same device, and apply no policy themselves: the root's policy
        recursion has already wrapped the whole tree, bottom-up.
        """
        return dataclasses.replace(self, device_id=device, auto_wrap_policy=None)


def _check(value: Any, types: type | tuple[type, ...], arg: str, fix: str) -> None:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        ok = False  # a bool is an int, but never a device index
    else:
        ok = isinstance(value, types)
    if not ok:
        raise TypeError(f"{arg}: got {value!r} ({type(value).__name__}); {fix}")
