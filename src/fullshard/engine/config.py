"""Configuration types with the names and members of ``torch.distributed.fsdp``.

``ShardingStrategy``, ``BackwardPrefetch``, ``MixedPrecision`` and ``CPUOffload`` accept what
torch's do. The engine reads these types; the front ends turn a user's values (strings, torch's
own objects) into them in :mod:`fullshard.frontend.options`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import nn

from fullshard.compat import BatchNormBase


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
        _module_classes_to_ignore: module classes kept in full precision, as torch FSDP1's field
            of the same name (default: BatchNorm's base class, as torch's). Read by
            ``FullyShardedDataParallel`` with an ``auto_wrap_policy`` only: every submodule of
            these classes becomes its own unit with mixed precision disabled (parameters,
            gradient reduction and buffers in their own dtype), its floating-point positional
            inputs cast to float32 and its floating-point outputs back to the inputs' dtype.
            Without an ``auto_wrap_policy`` they are not looked at (as in torch). ``()``:
            mixed precision everywhere. Stored as a tuple.

    Raises:
        ValueError: a dtype that is not a floating-point ``torch.dtype``.
        TypeError: ``_module_classes_to_ignore`` is not a sequence of nn.Module subclasses.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (BatchNormBase,)

    def __post_init__(self) -> None:
        self._module_classes_to_ignore = _module_classes(self._module_classes_to_ignore)
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecision.{name}={value!r} is not a floating-point torch.dtype; use "
                    "torch.bfloat16, torch.float16 or torch.float32 (or None to keep the original)"
                )


def _module_classes(value: Any) -> tuple[type[nn.Module], ...]:
    """``MixedPrecision._module_classes_to_ignore`` as a tuple, checked."""
    fix = "pass a tuple of module classes such as (torch.nn.BatchNorm2d,), or () for mixed precision everywhere"
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, AbstractSet)):
        raise TypeError(
            f"MixedPrecision._module_classes_to_ignore={value!r} is not a sequence of nn.Module subclasses; {fix}"
        )
    classes = tuple(value)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"MixedPrecision._module_classes_to_ignore holds {cls!r}, which is not an nn.Module subclass "
                f"(a class, not an instance or a name); {fix}"
            )
    return classes


@dataclasses.dataclass
class CPUOffload:
    """Keep parameter shards and their gradients in CPU memory when ``offload_params``."""

    offload_params: bool = False

    def __post_init__(self) -> None:
        # A string would be truthy whatever it says ("False"); 0 and 1 are taken, as torch takes them.
        if not isinstance(self.offload_params, (bool, int)) or self.offload_params not in (0, 1):
            raise TypeError(
                f"CPUOffload(offload_params=...) must be True or False, got {self.offload_params!r}; pass a bool"
            )


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


COMM_QUANT_PARAMS = (None, "int8")
COMM_QUANT_GRADS = (None, "bf16", "int8")


@dataclasses.dataclass(frozen=True)
class CommQuantization:
    """Fewer bytes on the wire: parameters all-gathered and gradients reduce-scattered quantized.

    Opt-in (``comm_quantization=`` of ``FullyShardedDataParallel`` and ``fully_shard``; the
    jobs' ``--comm-quant``); None, the default, communicates exactly as without it. Only the
    collectives within a unit's shard group change: a hybrid unit's replica all-reduce, a
    NO_SHARD unit (nothing to gather) and state dicts (always exact) are left as they are.

    Args:
        params: "int8": each rank quantizes its shards block-wise (``block_size`` elements per
            float32 scale, the block's largest magnitude / 127, rounded to nearest: error at
            most scale / 2) and the int8 blocks and scales are all-gathered, about 1.02 bytes
            per element instead of 4, then dequantized into the full parameters in the compute
            dtype (``param_dtype`` under mixed precision). The shards stay full precision and
            are what the optimizer updates, so the error does not accumulate in the weights.
            None: gathered exactly.
        grads: "bf16": each rank sends the other ranks' gradient chunks as bfloat16 (rounded to
            nearest; 2 bytes per element) and sums what it receives in float32. "int8": the
            chunks go as int8 blocks with float32 scales, rounded *stochastically* (unbiased:
            the expected value is the gradient), and are summed in float32. Stochastic rounding
            was chosen over error feedback by measurement (docs/comm_quantization.md): both
            ended a 300-step GPT run within 1% of the exact loss, and error feedback would keep
            a float32 residual of (N-1)/N of every gradient on each rank, where stochastic
            rounding keeps nothing. Blocks, here and for ``params``, never span two parameters.
            None: reduced exactly as without quantization (in ``reduce_dtype``).
        block_size: elements per block (one float32 scale each, 4 / block_size bytes per
            element); smaller blocks follow the values more closely and send more scales.

    Raises:
        ValueError: an unknown ``params`` or ``grads``, both None, or ``block_size`` out of
            [16, 65536].
        TypeError: ``block_size`` not an int.
    """

    params: str | None = "int8"
    grads: str | None = "bf16"
    block_size: int = 256

    def __post_init__(self) -> None:
        if self.params not in COMM_QUANT_PARAMS:
            raise ValueError(
                f"CommQuantization(params={self.params!r}): use 'int8' (block-quantized all-gather) or "
                "None (exact all-gather)"
            )
        if self.grads not in COMM_QUANT_GRADS:
            raise ValueError(
                f"CommQuantization(grads={self.grads!r}): use 'bf16', 'int8' or None (exact reduce-scatter)"
            )
        if self.params is None and self.grads is None:
            raise ValueError(
                "CommQuantization(params=None, grads=None) quantizes nothing; pass comm_quantization=None "
                "for exact communication, or set params='int8' and/or grads='bf16' / 'int8'"
            )
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(
                f"CommQuantization(block_size={self.block_size!r}): pass an int (elements per scale, e.g. 256)"
            )
        if not 16 <= self.block_size <= 65536:
            raise ValueError(
                f"CommQuantization(block_size={self.block_size}): use 16 to 65536 elements per scale "
                "(the scales cost 4 / block_size bytes per element; 256 is the default)"
            )

    @classmethod
    def from_spec(cls, spec: str) -> CommQuantization:
        """Parse a command-line spec (the jobs' ``--comm-quant``).

        Args:
            spec: a preset, "on" (the defaults: params int8, grads bf16) or "int8" (params and
                grads int8), or comma-separated ``key=value`` pairs over ``params``, ``grads``
                and ``block_size``, e.g. "params=int8,grads=bf16,block_size=128" ("none" as a
                value means None). Keys left out take the defaults.

        Raises:
            ValueError: an unknown preset, key or value, naming it and what is accepted; a key
                given twice.
        """
        text = spec.strip().lower()
        if text in _COMM_QUANT_PRESETS:
            return cls(**_COMM_QUANT_PRESETS[text])
        fields: dict[str, Any] = {}
        for part in text.split(","):
            key, eq, value = (s.strip() for s in part.partition("="))
            if not eq or key not in ("params", "grads", "block_size"):
                raise ValueError(
                    f"comm quantization spec {spec!r}: {part.strip()!r} is not key=value over params, grads, "
                    f"block_size, and the spec is not a preset ({', '.join(_COMM_QUANT_PRESETS)}); "
                    "e.g. 'params=int8,grads=bf16'"
                )
            if key in fields:
                raise ValueError(f"comm quantization spec {spec!r}: {key} is given twice; give each key once")
            if key == "block_size":
                if not (value.isascii() and value.isdigit()):
                    raise ValueError(f"comm quantization spec {spec!r}: block_size={value!r} is not a whole number")
                fields[key] = int(value)
            else:
                fields[key] = None if value == "none" else value
        return cls(**fields)


_COMM_QUANT_PRESETS: dict[str, dict[str, Any]] = {"on": {}, "int8": {"params": "int8", "grads": "int8"}}
