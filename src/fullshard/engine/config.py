"""Configuration types with the names and members of ``torch.distributed.fsdp``.

``ShardingStrategy``, ``BackwardPrefetch``, ``MixedPrecision`` and ``CPUOffload`` accept what
torch's do. The engine reads these types; the front ends turn a user's values (strings, torch's
own objects) into them in :mod:`fullshard.frontend.options`.
"""

from __future__ import annotations

import dataclasses
import enum

import torch


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across ranks.

    FULL_SHARD: shard all three; gather parameters before forward and again before backward,
        free them after each.
    SHARD_GRAD_OP: shard gradients and optimizer state; keep parameters gathered from forward
        through backward (one all-gather per step instead of two).
    NO_SHARD: replicate everything and all-reduce gradients, like DistributedDataParallel.
    HYBRID_SHARD / _HYBRID_SHARD_ZERO2: FULL_SHARD / SHARD_GRAD_OP inside a group, replicated
        across groups.
    """

    FULL_SHARD = 1
    SHARD_GRAD_OP = 2
    NO_SHARD = 3
    HYBRID_SHARD = 4
    _HYBRID_SHARD_ZERO2 = 5


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward.

    BACKWARD_PRE: when the current unit's backward starts (most overlap, one more unit alive).
    BACKWARD_POST: after the current unit's gradients are computed.
    """

    BACKWARD_PRE = 1
    BACKWARD_POST = 2


class FrontEnd(enum.Enum):
    """Which front end made a module head its unit (``engine.hooks.FSDPState.front_end``).

    WRAPPER: ``FullyShardedDataParallel`` (torch FSDP1's wrapper API).
    FULLY_SHARD: ``fully_shard`` (torch FSDP2's composable API).
    """

    WRAPPER = "FullyShardedDataParallel"
    FULLY_SHARD = "fully_shard"


@dataclasses.dataclass
class MixedPrecision:
    """Dtypes for the gathered parameters, the gradient reduction and the buffers.

    Args:
        param_dtype: dtype of the all-gather and of forward/backward compute.
        reduce_dtype: dtype of the gradient reduce-scatter.
        buffer_dtype: dtype of module buffers.
        keep_low_precision_grads: leave the sharded gradients in the reduce dtype.
        cast_forward_inputs: cast floating-point forward inputs of every unit to param_dtype.
        cast_root_forward_inputs: cast the root unit's floating-point inputs to param_dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecision.{name}={value!r} is not a floating-point torch.dtype; use "
                    "torch.bfloat16, torch.float16 or torch.float32 (or None to keep the original)"
                )


@dataclasses.dataclass
class CPUOffload:
    """Keep parameter shards and their gradients in CPU memory when ``offload_params``."""

    offload_params: bool = False


class StateDictType(enum.Enum):
    """What ``state_dict()`` returns under ``FullyShardedDataParallel.state_dict_type``.

    FULL_STATE_DICT: full tensors under the original names (gathered unit by unit).
    SHARDED_STATE_DICT: DTensor shards (``Shard(0)``) that torch.distributed.checkpoint reshards.
    LOCAL_STATE_DICT: this rank's shards as plain tensors (load only at the same world size).
    """

    FULL_STATE_DICT = 1
    LOCAL_STATE_DICT = 2
    SHARDED_STATE_DICT = 3


@dataclasses.dataclass
class StateDictConfig:
    """Base of the state-dict configs. ``offload_to_cpu``: values in CPU memory."""

    offload_to_cpu: bool = False


@dataclasses.dataclass
class FullStateDictConfig(StateDictConfig):
    """Full state dicts; with ``rank0_only`` only rank 0 receives one (others get ``{}``)."""

    rank0_only: bool = False


@dataclasses.dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Sharded (DTensor) state dicts."""


@dataclasses.dataclass
class LocalStateDictConfig(StateDictConfig):
    """Local-shard state dicts."""


@dataclasses.dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs."""

    offload_to_cpu: bool = False


@dataclasses.dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Full optimizer state dicts; with ``rank0_only`` only rank 0 receives one."""

    rank0_only: bool = False


@dataclasses.dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Sharded (DTensor) optimizer state dicts."""


class OptimStateKeyType(enum.Enum):
    """How an optimizer state dict names its parameters (see ``rekey_optim_state_dict``).

    PARAM_NAME: by original parameter name (``"blocks.0.lin.weight"``), as the FSDP optimizer
        state dicts are.
    PARAM_ID: by position in the optimizer's parameter groups (0, 1, ...), as
        ``torch.optim.Optimizer.state_dict()`` is.
    """

    PARAM_NAME = 1
    PARAM_ID = 2


@dataclasses.dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """The optimizer config that goes with LOCAL_STATE_DICT (optimizer state dicts are full there)."""


@dataclasses.dataclass
class StateDictSettings:
    """The state-dict type and configs in force on a model."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
