"""How optimizer state dicts name parameters: by original name or by id, and re-keying between them.

Two key types (:class:`~fullshard.api.OptimStateKeyType`). The FSDP optimizer state dicts key
each parameter's state by its original name (``"blocks.0.lin.weight"``). The form
``torch.optim.Optimizer.state_dict()`` returns and ``load_state_dict`` takes keys it by
*parameter id*: the parameter's position in the optimizer's parameter groups, counted across
groups. :func:`rekey_optim_state_dict` turns one into the other (torch FSDP1's static method).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fullshard.engine.config import OptimStateKeyType
from fullshard.state import optim_state

OptimInput = Iterable[Any] | None  # deprecated: the parameters, or parameter groups, given to the optimizer


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Re-key an optimizer state dict by parameter name or by parameter id (local).

    Turns a name-keyed dict (:func:`full_optim_state_dict`) into one an unwrapped model's
    optimizer loads, and an unwrapped optimizer's ``state_dict()`` into one
    :func:`shard_full_optim_state_dict` takes. Names are ``model``'s original names (wrapped or
    not); ids are positions in ``optim``'s parameter groups, or, without ``optim``, in
    ``optim_input`` (default ``model.parameters()``). As in torch, each group's ``params`` come
    out sorted, and a dict already keyed the asked way is returned as it is.

    Args:
        optim_state_dict: ``{"state": {key: {...}}, "param_groups": [...]}``, keyed all by names
            (str) or all by ids (int).
        optim_state_key_type: OptimStateKeyType.PARAM_NAME or OptimStateKeyType.PARAM_ID.
        model: the module whose parameter names to use.
        optim_input: deprecated; see above.
        optim: the optimizer whose parameter order defines the ids (preferred).

    Returns:
        A new dict keyed the asked way; the per-parameter state values are shared, not copied.

    Raises:
        TypeError: ``optim_state_key_type`` is not an OptimStateKeyType, or a malformed dict.
        ValueError: keys of both types, or a parameter (of ``optim``/``optim_input``) not in ``model``.
        KeyError: a name or id that has no parameter.
    """
    warn_optim_input(optim_input, optim)
    if not isinstance(optim_state_key_type, OptimStateKeyType):
        raise TypeError(
            "optim_state_key_type must be a fullshard.OptimStateKeyType (PARAM_NAME or PARAM_ID), got "
            f"{optim_state_key_type!r}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    optim_state.check_osd(optim_state_dict, "optim_state_dict")
    current = key_type(optim_state_dict)
    if current is None or current is optim_state_key_type:
        return optim_state_dict
    names = ordered_names(model, param_order(model, optim, optim_input))
    to_id = optim_state_key_type is OptimStateKeyType.PARAM_ID
    table: dict[Any, Any] = {name: i for i, name in enumerate(names)} if to_id else dict(enumerate(names))
    what = "parameter name" if to_id else "parameter id"
    where = f"the {len(names)} parameters of {'optim' if optim is not None else 'model'}"
    state = {lookup(table, k, what, where): v for k, v in optim_state_dict["state"].items()}
    groups = [
        with_params(g, [lookup(table, k, what, where) for k in g["params"]]) for g in optim_state_dict["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def warn_optim_input(optim_input: OptimInput, optim: torch.optim.Optimizer | None, needed: bool = True) -> None:
    """Warn for a given ``optim_input``: deprecated where used, unused where ``optim`` (or nothing) needs it.

    ``needed``: whether the caller reads ``optim_input`` at all when no ``optim`` is given.
    """
    if optim_input is None:
        return
    if needed and optim is None:
        warnings.warn(
            "optim_input is deprecated, as in torch; pass optim= (or neither) instead", FutureWarning, stacklevel=3
        )
        return
    source = "optim" if optim is not None else "optim itself"
    warnings.warn(
        f"optim_input is not used: the parameters are read from {source}; leave optim_input out "
        "(it is deprecated, as in torch)",
        UserWarning,
        stacklevel=3,
    )


def key_type(osd: dict[str, Any]) -> OptimStateKeyType | None:
    """The key type of ``osd`` (from its state, else its groups); None when it names no parameter."""
    keys = list(osd["state"]) or [k for g in osd["param_groups"] for k in g["params"]]
    if not keys:
        return None
    if all(isinstance(k, str) for k in keys):
        return OptimStateKeyType.PARAM_NAME
    if all(isinstance(k, int) for k in keys):
        return OptimStateKeyType.PARAM_ID
    raise ValueError(f"optimizer state dict keys must be all parameter names or all ids, got {keys[:6]}")


def param_order(model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: OptimInput) -> list[torch.Tensor]:
    """The parameters in id order: ``optim``'s, else ``optim_input``'s, else ``model.parameters()``."""
    if optim is not None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        return [p for g in optim.param_groups for p in g["params"]]
    if optim_input is None:
        return list(model.parameters())
    items = list(optim_input)
    if items and isinstance(items[0], dict):  # parameter groups
        return [p for g in items for p in ([g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])]
    return items


def ordered_names(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    names = optim_state.param_names(model)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(
            f"parameters at positions {missing[:6]} of the optimizer's parameters are not model's; pass "
            "the matching model"
        )
    return [names[id(p)] for p in params]


def lookup(table: dict[Any, Any], key: Any, what: str, where: str) -> Any:
    if key not in table:
        raise KeyError(f"{what} {key!r} of the optimizer state dict is not among the parameters of {where}")
    return table[key]


def with_params(group: dict[str, Any], params: list[Any]) -> dict[str, Any]:
    """A copy of a parameter group's settings with ``params`` (sorted, as torch does)."""
    return {**copy.deepcopy({k: v for k, v in group.items() if k != "params"}), "params": sorted(params)}
