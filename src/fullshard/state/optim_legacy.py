"""torch FSDP1's older optimizer-state functions, built on the name-keyed mapping of ``optim_state``.

torch deprecated them in favour of ``optim_state_dict`` / ``optim_state_dict_to_load`` but still
ships them, and FSDP1 programs call them: pytorch/examples' T5 example saves with
``full_optim_state_dict`` and loads with ``scatter_full_optim_state_dict``.
``FullyShardedDataParallel`` exposes each as a static method.

The *full* and *sharded* forms key each parameter's state by its original name, as
``optim_state`` does; the ``shard``/``scatter``/``flatten`` functions return the id-keyed form
``optimizer.load_state_dict`` takes (see :mod:`fullshard.state.optim_keys`), holding this
rank's rows of every parameter-shaped tensor. ``rekey_optim_state_dict`` lives in ``optim_keys``
and the broadcast behind ``scatter_full_optim_state_dict`` in ``optim_scatter``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine.config import OptimStateKeyType
from fullshard.engine.hooks import is_unit
from fullshard.state import optim_keys, optim_scatter, optim_state
from fullshard.state.optim_keys import OptimInput, rekey_optim_state_dict
from fullshard.state.state_dict import _sharded

__all__ = [
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: OptimInput = None,
    rank0_only: bool = True,
    group: collectives.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The optimizer's whole state, keyed by original parameter name, in CPU memory (collective).

    Deprecated (as in torch): prefer ``FullyShardedDataParallel.optim_state_dict``. Every rank
    calls it; each unit's state is gathered over the unit's process group.

    Args:
        model: the root FullyShardedDataParallel (or a module containing FSDP modules) whose
            parameters ``optim`` updates.
        optim: the optimizer over ``model``'s shards.
        optim_input: deprecated and not used (the parameters are read from ``optim``); warns.
        rank0_only: only rank 0 of ``group`` receives the dict; the other ranks get ``{}``.
        group: the group whose rank 0 receives it under ``rank0_only`` (default: the world).

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``, as
        torch's: a tensor of a parameter's shape has the full shape and the optimizer's dtype
        (``exp_avg``: float32 (d0, *rest) for a float32 parameter); scalars (``step``) as the
        optimizer keeps them. ``{}`` on ranks other than 0 with ``rank0_only``.

    Raises:
        TypeError: ``model`` is not a module or ``optim`` not a torch optimizer.
        ValueError: ``model`` contains no FSDP module, or ``optim`` holds parameters not in it.
    """
    _deprecated("full_optim_state_dict", "optim_state_dict")
    optim_keys.warn_optim_input(optim_input, optim, needed=False)
    _check_model(model)
    _check_optim(model, optim)
    keep = not rank0_only or collectives.group_rank(group if group is not None else collectives.default_group()) == 0
    osd = optim_state.full_optim_state_dict(model, optim, keep=keep, offload_to_cpu=True)
    return osd if keep else {}


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: collectives.ProcessGroup | None = None
) -> dict[str, Any]:
    """The optimizer's state keyed by original parameter name, this rank's rows as DTensors.

    Deprecated (as in torch): prefer ``optim_state_dict`` under ``SHARDED_STATE_DICT``. A
    tensor of a parameter's shape becomes a DTensor of the full shape (``Shard(0)`` over the
    unit's group) sharing storage with the optimizer's tensor; torch's returns ShardedTensors.
    Load it with :func:`flatten_sharded_optim_state_dict`, not ``optim.load_state_dict``.

    Args:
        model: the root FullyShardedDataParallel (or a module containing FSDP modules).
        optim: the optimizer over ``model``'s shards.
        group: accepted for torch's signature and ignored (each unit uses its own group).

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``.

    Raises:
        TypeError: ``model`` is not a module or ``optim`` not a torch optimizer.
        ValueError: ``model`` contains no FSDP module, or ``optim`` holds parameters not in it.
    """
    _deprecated("sharded_optim_state_dict", "optim_state_dict")
    if group is not None:
        warnings.warn(
            "sharded_optim_state_dict ignores group=: each FSDP unit shards over its own process group", stacklevel=2
        )
    _check_model(model)
    _check_optim(model, optim)
    return optim_state.sharded_optim_state_dict(model, optim)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """This rank's part of a full optimizer state dict, for ``optim.load_state_dict`` (local).

    Deprecated (as in torch): prefer ``optim_state_dict_to_load``. Every rank passes the whole
    dict; no communication. The world size may differ from the one that saved it.

    Args:
        full_optim_state_dict: name-keyed, full tensors (what :func:`full_optim_state_dict`
            returns, on any world size).
        model: the root FullyShardedDataParallel (or a module containing FSDP modules).
        optim_input: deprecated; without ``optim``, the parameters (or parameter groups) the
            optimizer was built from, in order (default: ``model.parameters()``).
        optim: the optimizer that will load the result (preferred; needed when ``model`` has a
            0-dim parameter).

    Returns:
        ``{"state": {id: {key: value}}, "param_groups": [{..., "params": [ids]}]}``: tensors
        of a parameter's full shape cut to this rank's rows (a copy), others as saved.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a malformed or id-keyed dict, a group-count mismatch with ``optim``, or a
            0-dim parameter without ``optim``.
        KeyError: a name that ``model`` lacks, or a parameter of ``optim`` with no state.
    """
    _deprecated("shard_full_optim_state_dict", "optim_state_dict_to_load")
    optim_keys.warn_optim_input(optim_input, optim)
    _check_model(model)
    return _to_load(full_optim_state_dict, "full_optim_state_dict", model, optim, optim_input)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """A dict from :func:`sharded_optim_state_dict`, for ``optim.load_state_dict`` (local).

    Deprecated (as in torch): prefer ``optim_state_dict_to_load``. The DTensors must be in
    ``model``'s current layout (same world size); to reshard, save and load through
    ``fullshard.checkpoint`` or torch.distributed.checkpoint.

    Args:
        sharded_optim_state_dict: name-keyed, DTensor shards (or full tensors).
        model: the root FullyShardedDataParallel (or a module containing FSDP modules).
        optim: the optimizer that will load the result.

    Returns:
        ``{"state": {id: {key: value}}, "param_groups": [{..., "params": [ids]}]}`` with this
        rank's rows as plain tensors (copies).

    Raises:
        TypeError, ValueError, KeyError: as :func:`shard_full_optim_state_dict`.
    """
    _deprecated("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    _check_model(model)
    if optim is None:
        raise TypeError("flatten_sharded_optim_state_dict needs optim=, the optimizer that will load the result")
    return _to_load(sharded_optim_state_dict, "sharded_optim_state_dict", model, optim, None)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
    group: collectives.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Send rank 0's full optimizer state dict to every rank, each keeping its part (collective).

    Deprecated (as in torch): prefer ``optim_state_dict_to_load``. Only rank 0 needs the dict in
    memory: it sends the structure and the scalars as one object, then broadcasts each
    parameter-shaped tensor in turn; every rank keeps its rows of it and drops the rest, so a
    rank other than 0 holds at most one full tensor at a time.

    Args:
        full_optim_state_dict: on rank 0 of ``group``, what :func:`full_optim_state_dict`
            returned (any world size); ignored on the other ranks (pass None).
        model, optim_input, optim: as :func:`shard_full_optim_state_dict`.
        group: the group to send over, rank 0 of it holding the dict (default: the world).

    Returns:
        As :func:`shard_full_optim_state_dict`, on every rank.

    Raises:
        ValueError: rank 0's dict is missing or malformed (raised on every rank), or as
            :func:`shard_full_optim_state_dict`.
        TypeError, KeyError: as :func:`shard_full_optim_state_dict`.
    """
    _deprecated("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    optim_keys.warn_optim_input(optim_input, optim)
    _check_model(model)
    group = group if group is not None else collectives.default_group()
    osd = optim_scatter.scatter(full_optim_state_dict, model, group, "full_optim_state_dict")
    return _to_load(osd, "full_optim_state_dict", model, optim, optim_input)


# ---------------------------------------------------------------------------- loading
def _to_load(
    osd: Any, arg: str, model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: OptimInput
) -> dict[str, Any]:
    """A name-keyed dict (full, this rank's rows, or DTensors) in the id-keyed form ``optim`` loads."""
    optim_state.check_osd(osd, arg)
    if optim_keys.key_type(osd) is OptimStateKeyType.PARAM_ID:
        raise ValueError(
            f"{arg} is keyed by parameter ids (as optimizer.state_dict() is); key it by names first: "
            f"FSDP.rekey_optim_state_dict({arg}, OptimStateKeyType.PARAM_NAME, model, optim=optim)"
        )
    if optim is None:
        return _to_load_by_order(osd, model, optim_keys.param_order(model, None, optim_input))
    _check_optim(model, optim)
    return optim_state.to_load(model, optim, osd, arg)


def _to_load_by_order(osd: dict[str, Any], model: nn.Module, params: list[torch.Tensor]) -> dict[str, Any]:
    """Without an optimizer: ids are positions in ``params``; tensors of a parameter's full shape are cut."""
    names = optim_keys.ordered_names(model, params)
    ids = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for name, entry in osd["state"].items():
        i = optim_keys.lookup(ids, name, "parameter name", "model")
        state[i] = {k: _rows(v, params[i], name, k) for k, v in entry.items()}
    groups = [
        optim_keys.with_params(g, [optim_keys.lookup(ids, n, "parameter name", "model") for n in g["params"]])
        for g in osd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _rows(value: Any, param: torch.Tensor, name: str, key: str) -> Any:
    """A copy of a state value: this rank's rows of it when it has the parameter's full shape.

    A copy, never the value itself: ``optim.load_state_dict`` keeps scalar tensors (``step``) as
    given and steps them in place, which would change the dict loaded from.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if any(pl.is_shard() for pl in value.placements):
            return value.to_local().clone()  # this rank's rows, in this layout
        value = value.to_local()  # replicated: the whole value
    sp = _sharded(param)
    if not isinstance(value, torch.Tensor):
        return value
    if sp is None or tuple(value.shape) != tuple(sp.spec.orig_shape):
        return value.clone()  # scalar state (step), an unsharded parameter's, or rows already cut
    if value.dim() == 0:
        raise ValueError(
            f"parameter {name!r} is 0-dim, so its state {key!r} cannot be told apart from scalar state such "
            "as 'step' without the optimizer; pass optim=<the optimizer that will load the result>"
        )
    return sp.spec.local_slice(value).clone()


# ---------------------------------------------------------------------------- checks and keys
def _deprecated(name: str, new: str) -> None:
    warnings.warn(
        f"FullyShardedDataParallel.{name} is deprecated, as in torch; use FullyShardedDataParallel.{new}",
        FutureWarning,
        stacklevel=3,
    )


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module, got {type(model).__name__}; pass the root FullyShardedDataParallel"
        )
    if not any(is_unit(m) for m in model.modules()):
        raise ValueError(
            f"model ({type(model).__name__}) contains no FullyShardedDataParallel module; pass the wrapped model "
            "(for an unwrapped model's optimizer use rekey_optim_state_dict)"
        )


def _check_optim(model: nn.Module, optim: Any) -> None:
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}; pass the optimizer over model's shards"
        )
    optim_state.check_model_params(optim_state.param_names(model), optim)
