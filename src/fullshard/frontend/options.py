"""Where the front ends take their options: strings and torch's own option objects.

:func:`parse_sharding_strategy` accepts the member names of ``ShardingStrategy`` as strings in
any case ("full_shard"), which the command-line jobs use. The ``as_*`` normalizers accept
fullshard's config objects and torch's own ones, so a program that switched only its imports
still runs: enums are translated by member name and dataclasses field by field. A torch field
that fullshard has no counterpart for warns when its value asks for something fullshard does
not do; none is dropped silently.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import warnings
from typing import Any, TypeVar

import torch

from fullshard.engine.config import (
    BackwardPrefetch,
    CommQuantization,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)

_STATE_DICT_CONFIGS: dict[str, type] = {
    c.__name__: c for c in (StateDictConfig, FullStateDictConfig, ShardedStateDictConfig, LocalStateDictConfig)
}
_OPTIM_STATE_DICT_CONFIGS: dict[str, type] = {
    c.__name__: c
    for c in (OptimStateDictConfig, FullOptimStateDictConfig, ShardedOptimStateDictConfig, LocalOptimStateDictConfig)
}


def parse_sharding_strategy(value: Any) -> ShardingStrategy:
    """Turn None, a ShardingStrategy (fullshard's or torch's) or a member name (any case) into one.

    Args:
        value: None (FULL_SHARD), ``fullshard.ShardingStrategy``,
            ``torch.distributed.fsdp.ShardingStrategy``, or a member name such as "full_shard".

    Returns:
        fullshard's ShardingStrategy.

    Raises:
        ValueError: an unknown name, listing the valid ones.
        TypeError: a value of another type.
    """
    if value is None:
        return ShardingStrategy.FULL_SHARD
    if isinstance(value, ShardingStrategy):
        return value
    if _is_torch(value, "ShardingStrategy"):
        return _from_torch_enum(value, ShardingStrategy, "sharding_strategy")
    if isinstance(value, str):
        key = value.strip().upper().replace("-", "_")
        if key in ShardingStrategy.__members__:
            return ShardingStrategy[key]
        valid = ", ".join(m.lower() for m in ShardingStrategy.__members__)
        raise ValueError(f"sharding_strategy={value!r} is not a strategy; use one of: {valid}")
    raise TypeError(
        f"sharding_strategy must be a ShardingStrategy (fullshard's or torch.distributed.fsdp's) "
        f"or its name, got {type(value).__name__}"
    )


def as_backward_prefetch(value: Any) -> BackwardPrefetch | None:
    """Normalize ``backward_prefetch``: None, or a BackwardPrefetch (fullshard's or torch's).

    Returns:
        fullshard's BackwardPrefetch, or None (no prefetch).

    Raises:
        TypeError: anything else.
    """
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    if _is_torch(value, "BackwardPrefetch"):
        return _from_torch_enum(value, BackwardPrefetch, "backward_prefetch")
    raise TypeError(
        f"backward_prefetch must be a BackwardPrefetch (fullshard's or torch.distributed.fsdp's) or None, got {value!r}"
    )


def as_mixed_precision(value: Any) -> MixedPrecision | None:
    """Normalize ``mixed_precision``: None, a MixedPrecision, or a dtype meaning all three dtypes.

    Args:
        value: None, ``fullshard.MixedPrecision``, ``torch.distributed.fsdp.MixedPrecision``
            (every field carried over, ``_module_classes_to_ignore`` included), or a
            floating-point torch.dtype (all three dtypes; the other fields, BatchNorm kept in
            full precision among them, take the dataclass's defaults).

    Returns:
        fullshard's MixedPrecision, or None (no mixed precision).

    Raises:
        ValueError: a dtype that is not floating point.
        TypeError: anything else.
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, torch.dtype):
        return MixedPrecision(param_dtype=value, reduce_dtype=value, buffer_dtype=value)
    if _is_torch(value, "MixedPrecision"):
        return _from_torch_dataclass(value, MixedPrecision, "mixed_precision")
    raise TypeError(
        f"mixed_precision must be a MixedPrecision (fullshard's or torch.distributed.fsdp's) or a "
        f"torch.dtype such as torch.bfloat16, got {type(value).__name__}"
    )


def as_comm_quantization(value: Any, caller: str) -> CommQuantization | None:
    """Check ``comm_quantization``: None (exact communication) or a CommQuantization.

    Raises:
        TypeError: another type, naming ``caller``'s argument and what to pass.
    """
    if value is None or isinstance(value, CommQuantization):
        return value
    raise TypeError(
        f"{caller}: comm_quantization={value!r} ({type(value).__name__}); pass "
        "fullshard.CommQuantization(params='int8', grads='bf16' or 'int8' or None, block_size=256), "
        "or None for exact communication"
    )


def as_cpu_offload(value: Any) -> CPUOffload:
    """Normalize ``cpu_offload``: None, a bool (the shorthand), or a CPUOffload (fullshard's or torch's).

    Returns:
        fullshard's CPUOffload (``offload_params=False`` for None).

    Raises:
        TypeError: anything else.
    """
    if value is None:
        return CPUOffload()
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    if isinstance(value, CPUOffload):
        return value
    if _is_torch(value, "CPUOffload"):
        return _from_torch_dataclass(value, CPUOffload, "cpu_offload")
    raise TypeError(
        f"cpu_offload must be a CPUOffload (fullshard's or torch.distributed.fsdp's) or a bool, "
        f"got {type(value).__name__}"
    )


_P = TypeVar("_P")
_O = TypeVar("_O")


def as_mp_policy(value: Any, policy: type[_P]) -> _P | None:
    """Normalize ``fully_shard``'s ``mp_policy``: None, or a MixedPrecisionPolicy (fullshard's or torch's).

    Args:
        value: the argument as given.
        policy: fullshard's MixedPrecisionPolicy class. ``fully_shard`` passes it in: it is
            defined beside ``fully_shard``, which imports this module, not the other way round.

    Returns:
        an instance of ``policy`` with torch's field values, ``value`` itself, or None.

    Raises:
        TypeError: anything else (torch's FSDP1 ``MixedPrecision`` included).
    """
    if value is None or isinstance(value, policy):
        return value
    if _is_torch(value, "MixedPrecisionPolicy"):
        return _from_torch_dataclass(value, policy, "mp_policy")
    hint = "; MixedPrecision is FullyShardedDataParallel's option" if type(value).__name__ == "MixedPrecision" else ""
    raise TypeError(
        f"mp_policy must be a MixedPrecisionPolicy (fullshard's or torch.distributed.fsdp's) or None, "
        f"got {type(value).__name__}{hint}"
    )


def as_offload_policy(value: Any, no_offload: type[_O], cpu_offload: type[_O]) -> _O | None:
    """Normalize ``fully_shard``'s ``offload_policy``: None, or an OffloadPolicy (fullshard's or torch's).

    Args:
        value: the argument as given.
        no_offload: fullshard's OffloadPolicy class (passed in as for :func:`as_mp_policy`).
        cpu_offload: fullshard's CPUOffloadPolicy class, a subclass of ``no_offload``.

    Returns:
        ``value`` itself, None, or for torch's ``CPUOffloadPolicy`` / ``OffloadPolicy`` an
        instance of ``cpu_offload`` / ``no_offload`` with its field values (``pin_memory``).

    Raises:
        TypeError: anything else (torch's FSDP1 ``CPUOffload`` included).
    """
    if value is None or isinstance(value, no_offload):
        return value
    if _is_torch(value, "CPUOffloadPolicy"):
        return _from_torch_dataclass(value, cpu_offload, "offload_policy")
    if _is_torch(value, "OffloadPolicy"):
        return _from_torch_dataclass(value, no_offload, "offload_policy")
    hint = "; CPUOffload is FullyShardedDataParallel's option" if type(value).__name__ == "CPUOffload" else ""
    raise TypeError(
        f"offload_policy must be an OffloadPolicy such as CPUOffloadPolicy() (fullshard's or "
        f"torch.distributed.fsdp's) or None, got {type(value).__name__}{hint}"
    )


def as_state_dict_type(value: Any) -> StateDictType:
    """Normalize ``state_dict_type``: a StateDictType, fullshard's or torch's.

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, StateDictType):
        return value
    if _is_torch(value, "StateDictType"):
        return _from_torch_enum(value, StateDictType, "state_dict_type")
    raise TypeError(f"state_dict_type must be a StateDictType (fullshard's or torch.distributed.fsdp's), got {value!r}")


def as_optim_state_key_type(value: Any) -> Any:
    """torch's ``OptimStateKeyType`` as fullshard's (what Lightning passes to
    ``rekey_optim_state_dict``); anything else unchanged, for the callee to check."""
    if _is_torch(value, "OptimStateKeyType"):
        return _from_torch_enum(value, OptimStateKeyType, "optim_state_key_type")
    return value


def as_state_dict_config(value: Any) -> StateDictConfig | None:
    """Normalize ``state_dict_config``: None, or a StateDictConfig (fullshard's or torch's).

    Torch's ``FullStateDictConfig``, ``ShardedStateDictConfig`` and ``LocalStateDictConfig``
    become fullshard's class of the same name, every field carried over.

    Raises:
        TypeError: anything else (an optimizer config included).
    """
    if value is None or isinstance(value, StateDictConfig):
        return value
    if _is_torch(value, "StateDictConfig"):
        return _from_torch_dataclass(value, _same_name(value, _STATE_DICT_CONFIGS), "state_dict_config")
    raise TypeError(
        f"state_dict_config must be a StateDictConfig such as FullStateDictConfig() (fullshard's or "
        f"torch.distributed.fsdp's) or None, got {type(value).__name__}"
    )


def as_optim_state_dict_config(value: Any) -> OptimStateDictConfig | None:
    """Normalize ``optim_state_dict_config``: None, or an OptimStateDictConfig (fullshard's or torch's).

    Torch's ``FullOptimStateDictConfig``, ``ShardedOptimStateDictConfig`` and
    ``LocalOptimStateDictConfig`` become fullshard's class of the same name, every field carried over.

    Raises:
        TypeError: anything else (a model state-dict config included).
    """
    if value is None or isinstance(value, OptimStateDictConfig):
        return value
    if _is_torch(value, "OptimStateDictConfig"):
        return _from_torch_dataclass(value, _same_name(value, _OPTIM_STATE_DICT_CONFIGS), "optim_state_dict_config")
    raise TypeError(
        f"optim_state_dict_config must be an OptimStateDictConfig such as FullOptimStateDictConfig() "
        f"(fullshard's or torch.distributed.fsdp's) or None, got {type(value).__name__}"
    )


# ---------------------------------------------------------------------- torch's option objects
# Torch fields fullshard has no field for: (the value that describes what fullshard does, why).
# Any other torch field without a counterpart (a later torch may add one) warns unless it holds
# torch's default.
_NO_COUNTERPART: dict[str, tuple[Any, str]] = {
    "_use_dtensor": (
        True,
        "torch gives ShardedTensor values when it is False; fullshard's sharded state dicts always "
        "hold DTensors, which torch.distributed.checkpoint saves and loads alike",
    ),
}


def _torch_fsdp() -> Any:
    """``torch.distributed.fsdp`` if it is loaded, else None.

    Torch's option objects exist only once that module is imported, so recognizing them never
    needs to import it (which takes about half a second).
    """
    return sys.modules.get("torch.distributed.fsdp")


def _is_torch(value: Any, name: str) -> bool:
    """Whether ``value`` is an instance of ``torch.distributed.fsdp.<name>``."""
    cls = getattr(_torch_fsdp(), name, None)
    return isinstance(cls, type) and isinstance(value, cls)


_E = TypeVar("_E", bound=enum.Enum)


def _from_torch_enum(value: enum.Enum, ours: type[_E], arg: str) -> _E:
    """fullshard's member of ``ours`` with the name of torch's member ``value``."""
    if value.name in ours.__members__:
        return ours[value.name]
    raise ValueError(
        f"{arg}={type(value).__name__}.{value.name} (torch's) has no fullshard counterpart; use one "
        f"of: {', '.join(ours.__members__)}"
    )


def _same_name(value: Any, ours: dict[str, type]) -> type:
    """fullshard's class named like ``value``'s torch class (or its nearest torch base)."""
    return next(ours[c.__name__] for c in type(value).__mro__ if c.__name__ in ours)


def _from_torch_dataclass(value: Any, ours: type[_P], arg: str) -> _P:
    """An instance of fullshard's ``ours`` holding the field values of torch's dataclass ``value``.

    Fields ``ours`` lacks warn (UserWarning) when their value asks for something fullshard does
    not do; see :data:`_NO_COUNTERPART`.
    """
    names = {f.name for f in dataclasses.fields(ours)} if dataclasses.is_dataclass(ours) else set()
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(value):
        field_value = getattr(value, field.name)
        if field.name in names:
            kwargs[field.name] = field_value
            continue
        matches, why = _NO_COUNTERPART.get(field.name, (_default(field), "fullshard has no such setting"))
        if field_value != matches:
            warnings.warn(
                f"{arg}: torch's {type(value).__name__}.{field.name}={field_value!r} has no counterpart in "
                f"fullshard and is not used: {why}",
                UserWarning,
                stacklevel=4,
            )
    return ours(**kwargs)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


# ---------------------------------------------------------------------- settings without effect
def warn_unused(setting: str, why: str, stacklevel: int) -> None:
    """Warn (UserWarning) that ``setting``, which a user passed, does nothing in fullshard, and why.

    Args:
        setting: the argument or field and its value, as the user wrote it.
        why: what fullshard does instead, and what to pass.
        stacklevel: as for ``warnings.warn``, counted from the caller of this function.
    """
    warnings.warn(f"FullyShardedDataParallel: {setting} is not used: {why}", UserWarning, stacklevel=stacklevel + 1)
