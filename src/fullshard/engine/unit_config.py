"""The states an FSDP unit moves through and the settings it is built with (read by the layout,
the unit, the hooks and the front ends)."""

from __future__ import annotations

import dataclasses
import enum

import torch

from fullshard.engine.config import CommQuantization


class ShardState(enum.Enum):
    """Whether a unit's full parameters are gathered (UNSHARDED) or only its shards held (SHARDED)."""

    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    """Where a unit is in a step: IDLE between steps, in FORWARD, waiting for its backward
    (PRE_BACKWARD: its backward hooks ran, gradients pending) or after it (POST_BACKWARD)."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclasses.dataclass(frozen=True)
class UnitConfig:
    """How a unit shards, computes and reduces.

    Attributes:
        compute_device: where forward/backward run and the collectives move data.
        reshard_after_forward: free the full parameters after forward (FULL_SHARD).
        param_dtype: dtype of the all-gather and of compute (None: the parameters' dtype).
        reduce_dtype: dtype of the gradient reduction (None: the compute dtype).
        keep_low_precision_grads: leave the shards' gradients in the reduce dtype.
        offload: keep shards and their gradients in CPU memory (pinned when CUDA exists).
        keep_param_objects: register the original Parameter objects, their ``.data`` now the
            shard (torch FSDP1's ``use_orig_params``: an optimizer built before wrapping trains
            them); otherwise new Parameters.
        comm_quantization: gather parameters and/or reduce gradients quantized (None: exactly).
    """

    compute_device: torch.device
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    offload: bool = False
    keep_param_objects: bool = False
    comm_quantization: CommQuantization | None = None
