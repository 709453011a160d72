"""BatchNorm under mixed precision in the estimator's sweep (the ResNet family has it).

The FSDP1 wrapper keeps every BatchNorm in float32 as a unit of its own by default
(``MixedPrecision._module_classes_to_ignore``). ``fully_shard`` has no such default: a BatchNorm
in a bfloat16 unit meets its float32 running statistics, which the CPU kernel refuses
("expected scalar type BFloat16 but found Float", under torch's fully_shard as under
fullshard's), so the sweep gives it the same treatment the FSDP2 way (:func:`in_float32`), and
the estimate is asked for it (``full_precision``). :func:`engine_units` names the units the
engine then has, for the measured moment.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.jobs.planning.sweep import Config


def engine_units(c: Config, is_unit: Any) -> Any:
    """The modules the engine makes units of under ``c``: ``is_unit``'s, and under mixed
    precision every BatchNorm too (units of their own in full precision: the FSDP1 wrapper's
    ``MixedPrecision._module_classes_to_ignore``, :func:`in_float32` under
    ``fully_shard``), so that the measured moment names the unit that runs as the estimate
    names it. ``is_unit``: the family's policy, module -> bool; returns another."""
    if c.precision == "fp32":
        return is_unit
    return lambda m: is_unit(m) or isinstance(m, compat.BatchNormBase)


def in_float32(model: nn.Module, cpu_offload: bool, mesh: Any, reshard: bool) -> None:
    """Each BatchNorm of ``model`` its own ``fully_shard`` unit computing in float32 (inputs
    cast up, outputs cast back to bfloat16, gradients reduced in float32): FSDP2's way to what
    the FSDP1 wrapper does by default (``MixedPrecision._module_classes_to_ignore``). Without it
    a bf16 BatchNorm meets its float32 running statistics, which the CPU kernel refuses
    ("expected scalar type BFloat16 but found Float"), under torch's fully_shard as under ours.

    Args:
        model: the plain model, before its other units are sharded (BatchNorm units first, so
            that the enclosing units leave their parameters to them).
        cpu_offload: shards in host memory, as the other units'.
        mesh: the DeviceMesh the other units use, or None (the world).
        reshard: free the gathered parameters after forward (FULL_SHARD), as the other units.
    """
    from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    kwargs: dict[str, Any] = {"mp_policy": mp, "reshard_after_forward": reshard, "mesh": mesh}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for m in model.modules():
        if isinstance(m, compat.BatchNormBase):
            fully_shard(m, **kwargs)
