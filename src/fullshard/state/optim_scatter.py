"""Sending rank 0's full optimizer state dict to every rank, each keeping only its rows.

Only rank 0 needs the dict in memory: it sends the structure and the scalars as one object,
then broadcasts each parameter-shaped tensor in turn; every rank keeps its rows of it and drops
the rest, so a rank other than 0 holds at most one full tensor at a time. Used by
``scatter_full_optim_state_dict`` and by ``optim_state_dict_to_load`` under ``rank0_only``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine.module_wrapper import clean_name
from fullshard.state import optim_state
from fullshard.state.state_dict import _sharded


def scatter(osd: dict[str, Any] | None, model: nn.Module, group: collectives.ProcessGroup, arg: str) -> dict[str, Any]:
    """Rank 0's name-keyed full ``osd``, on every rank, with this rank's rows of each parameter's state.

    Collective over ``group``; ``osd`` is read on its rank 0 only (pass None elsewhere).

    Args:
        osd: on rank 0 of ``group``, a name-keyed optimizer state dict of full tensors.
        model: the module whose parameters (shards) say which rows each rank keeps.
        group: the group to send over.
        arg: the caller's name for ``osd``, for errors.

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [...]}``: tensors of a sharded
        parameter's full shape cut to this rank's rows (copies), others whole.

    Raises:
        ValueError: rank 0's ``osd`` is missing or malformed (raised on every rank).
        TypeError: on rank 0, ``osd`` is not an optimizer state dict.
    """
    tensors: list[torch.Tensor] = []
    problem: Exception | None = None
    message: tuple[Any, str | None] = (None, None)
    if collectives.group_rank(group) == 0:
        try:
            if osd is None:
                raise ValueError(f"{arg} is None on rank 0; rank 0 must pass the full optimizer state dict")
            optim_state.check_osd(osd, arg)
            message = (_skeleton(osd, tensors, arg), None)
        except (TypeError, ValueError) as e:
            problem, message = e, (None, f"{type(e).__name__}: {e}")
    skeleton, error = collectives.broadcast_object(message, 0, group)
    if problem is not None:
        raise problem
    if error is not None:
        raise ValueError(f"rank 0's {arg} is unusable ({error}); pass rank 0 a full, name-keyed optimizer state dict")
    return _receive(skeleton, tensors, model, group)


@dataclasses.dataclass(frozen=True)
class _Sent:
    """Stands in the broadcast object for a tensor that follows by itself."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton(osd: dict[str, Any], tensors: list[torch.Tensor], arg: str) -> dict[str, Any]:
    """``osd`` with each tensor of one or more dims replaced by a :class:`_Sent`, appended to ``tensors``."""
    from torch.distributed.tensor import DTensor

    state: dict[Any, dict[str, Any]] = {}
    for name, entry in osd["state"].items():
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, DTensor):
                raise ValueError(
                    f"{arg} holds a DTensor at {name!r}/{key!r}; pass full tensors (save under "
                    "FULL_STATE_DICT), or load sharded state with flatten_sharded_optim_state_dict"
                )
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors.append(value)
                value = _Sent(tuple(value.shape), value.dtype)
            out[key] = value
        state[name] = out
    return {"state": state, "param_groups": osd["param_groups"]}


def _receive(
    skeleton: dict[str, Any], tensors: list[torch.Tensor], model: nn.Module, group: collectives.ProcessGroup
) -> dict[str, Any]:
    """Fill the skeleton by one broadcast per tensor, in skeleton order; each rank keeps its rows."""
    params = {clean_name(n): p for n, p in model.named_parameters()}
    sent = iter(tensors)
    state: dict[Any, dict[str, Any]] = {}
    for name, entry in skeleton["state"].items():
        sp = _sharded(params[name]) if name in params else None
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, _Sent):
                mine = next(sent, None)
                flat = (
                    mine.detach().reshape(-1).contiguous()
                    if mine is not None
                    else torch.empty(math.prod(value.shape), dtype=value.dtype)
                )
                collectives.broadcast(flat, 0, group)
                value = flat.reshape(value.shape)
                if sp is not None and tuple(value.shape) == tuple(sp.spec.orig_shape):
                    value = sp.spec.local_slice(value).clone()
            out[key] = value
        state[name] = out
    return {"state": state, "param_groups": skeleton["param_groups"]}
