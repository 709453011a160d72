"""The shard dim of each parameter ``fully_shard`` takes: what its ``shard_placement_fn`` returns.

torch's ``fully_shard`` calls ``shard_placement_fn(param)`` for each parameter: ``Shard(d)``
shards it along dim d (a negative d counts from the end), None along dim 0. fullshard marks the
parameters with another dim for the engine's layout (:class:`~fullshard.engine.sharded_param.ShardSpec`
takes it), which keeps each rank's ``torch.chunk`` of that dim contiguous, as torch's does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

MARK = "_fullshard_shard_dim"  # the attribute holding a parameter's shard dim (> 0)


def mark(module: nn.Module, shard_placement_fn: Optional[Callable[[nn.Parameter], Any]]) -> None:
    """Refuse 0-dim parameters; mark each parameter ``shard_placement_fn`` shards along a dim
    d > 0 (``Shard(d)``, a negative d counted from the end as torch does) for the engine's layout.

    Raises:
        ValueError: a 0-dim parameter; a dim out of range for the parameter.
        NotImplementedError: a placement other than Shard(d) or None; Shard(d > 0) for a
            tensor-parallel or tensor-subclass parameter.
    """
    from torch.distributed.tensor import Shard

    dims: list[tuple[nn.Parameter, int]] = []
    taken: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if hasattr(p, "_fullshard_param") or hasattr(p, "_fullshard_ignored"):
            continue
        taken.append(p)
        if p.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard the 0-dim parameter {name!r} (torch's fully_shard cannot "
                "either): make it a tensor of shape (1,), or pass it in ignored_params"
            )
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned {placement!r} for {name!r}; return Shard(dim) or None"
            )
        dim = placement.dim + p.dim() if placement.dim < 0 else placement.dim
        if not 0 <= dim < p.dim():
            raise ValueError(
                f"fully_shard: shard_placement_fn returned {placement!r} for {name!r} of shape {tuple(p.shape)}: dim "
                f"{placement.dim} is out of range for a {p.dim()}-D parameter; return Shard(d) with "
                f"{-p.dim()} <= d < {p.dim()}, or None for Shard(0)"
            )
        if dim == 0:
            continue
        if hasattr(p, "_fullshard_tp_spec") or type(p.data) is not torch.Tensor:
            kind = "tensor-parallel" if hasattr(p, "_fullshard_tp_spec") else type(p).__name__
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned {placement!r} for the {kind} parameter {name!r}; fullshard "
                "shards tensor-parallel and tensor-subclass parameters along dim 0 only (return Shard(0) or None)"
            )
        dims.append((p, dim))
    for p in taken:  # a mark left by an earlier fully_shard of this module that failed after marking
        p.__dict__.pop(MARK, None)
    for p, dim in dims:  # marked once all are checked
        setattr(p, MARK, dim)  # read by the engine's layout
