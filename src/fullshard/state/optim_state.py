"""The optimizer-state mapping: between an optimizer over shards and state keyed by parameter name.

A torch optimizer over fullshard's shards keeps per-parameter tensors (``exp_avg``...) of the
shard's shape. The sharded form keys them by the parameter's original name and wraps each
shard-shaped tensor as a DTensor of the full shape (as the model's sharded state dict does), so
torch.distributed.checkpoint can reshard it to another world size. The full form holds full
tensors. Scalars (``step``) stay as they are.

Format: ``{"state": {name: {key: value}}, "param_groups": [{hyper-parameters, "params": [names]}]}``.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from fullshard import compat
from fullshard.comm import collectives
from fullshard.engine.inference_guard import outside_inference_mode
from fullshard.engine.module_wrapper import clean_name
from fullshard.state.state_dict import _sharded, _unit_of_param, as_dtensor, unit_mesh


class StateView:
    """An optimizer's parameters with the state and hyper-parameters of one of its own state dicts.

    Stands in for the optimizer when a caller gives the id-keyed dict ``optim.state_dict()``
    returned (torch's ``optim_state_dict(model, optim, optim_state_dict=...)``): ids are
    positions in ``optimizer``'s parameter groups, counted across groups.

    Raises:
        TypeError: ``osd`` is not an optimizer state dict.
        ValueError: a key that is no parameter id of ``optimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, osd: Any, arg: str) -> None:
        check_osd(osd, arg)
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def param(i: Any) -> torch.Tensor:
            if not isinstance(i, int) or not 0 <= i < len(params):
                raise ValueError(
                    f"{arg}: {i!r} is not a parameter id of optim (0 to {len(params) - 1}); pass optim.state_dict()"
                )
            return params[i]

        self.state: dict[torch.Tensor, dict[str, Any]] = {param(i): entry for i, entry in osd["state"].items()}
        self.param_groups: list[dict[str, Any]] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [param(i) for i in g["params"]]}
            for g in osd["param_groups"]
        ]


Optim = Union[torch.optim.Optimizer, StateView]  # what the saving functions read the state from


def check_osd(osd: Any, arg: str) -> None:
    """Check that argument ``arg`` is shaped like an optimizer state dict.

    Raises:
        TypeError: it is not ``{"state": dict, "param_groups": list, ...}``.
    """
    if (
        not isinstance(osd, dict)
        or not isinstance(osd.get("state"), dict)
        or not isinstance(osd.get("param_groups"), list)
    ):
        got = sorted(osd) if isinstance(osd, dict) else type(osd).__name__
        raise TypeError(f"{arg} must be an optimizer state dict {{'state': dict, 'param_groups': list}}, got {got}")


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its original name (the first, for a tied parameter).

    ``model`` may be a FullyShardedDataParallel or any module containing some.
    """
    return {id(p): clean_name(name) for name, p in model.named_parameters()}


def check_model_params(names: dict[int, str], optimizer: Any) -> None:
    """Every parameter the optimizer holds must be one of the model's (``names``: ``param_names``).

    Raises:
        ValueError: one is not, with the fix.
    """
    strays = sum(id(p) not in names for g in optimizer.param_groups for p in g["params"])
    if strays:
        raise ValueError(
            f"the optimizer holds {strays} parameter(s) that are not the model's, so its state dict cannot name "
            "them; build the optimizer on model.parameters() after wrapping (give other parameters an optimizer of "
            "their own)"
        )


@outside_inference_mode  # the next optimizer.step() updates the state in place
def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state where it has none, without changing any parameter or any
    state that exists (a step with lr 0 and zero grads over only the parameters that lack it).

    Loading needs existing state tensors to load into; torch creates them lazily at the first
    step. The step counters this leaves are overwritten by the load; a load that fails leaves
    the state it found as it was (its new entries are dropped by the caller).
    """
    missing = [
        [p for p in g["params"] if p.requires_grad and not optimizer.state.get(p)] for g in optimizer.param_groups
    ]
    if not any(missing):
        return
    saved = [(g["params"], g["lr"]) for g in optimizer.param_groups]
    fresh = [p for group in missing for p in group]
    saved_grads = {p: p.grad for p in fresh}
    for p in fresh:
        p.grad = torch.zeros_like(p)
    try:
        for g, params in zip(optimizer.param_groups, missing):
            g["params"] = params  # the parameters with state stay out of this step
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        optimizer.step()
    finally:
        for g, (params, lr) in zip(optimizer.param_groups, saved):
            g["params"], g["lr"] = params, lr
        for p in fresh:
            p.grad = saved_grads[p]


def sharded_optim_state_dict(model: nn.Module, optimizer: Optim) -> dict[str, Any]:
    """The optimizer's state by parameter name, shard-shaped tensors as DTensors (full shape).

    The DTensors share storage with the optimizer's tensors, so a checkpoint load writes them
    in place. Collective only for 0-dim sharded parameters.
    """
    from torch.distributed.tensor import Shard

    names = param_names(model)
    check_model_params(names, optimizer)
    units = _unit_of_param(model)
    state: dict[str, dict[str, Any]] = {}
    for p, entry in optimizer.state.items():
        if id(p) not in names:
            continue
        sp = _sharded(p)
        unit = units.get(id(sp)) if sp is not None else None
        mesh = unit_mesh(unit) if unit is not None else None
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if (
                mesh is not None
                and sp is not None
                and unit is not None
                and isinstance(value, torch.Tensor)
                and value.shape == p.shape
            ):
                out[key] = as_dtensor(sp, value, unit, mesh, [Shard(0)])
            elif isinstance(value, torch.Tensor) and sp is not None and value.shape == p.shape:
                out[key] = value.reshape(sp.spec.orig_shape)  # held whole on every rank
            else:
                out[key] = value
        state[names[id(p)]] = out
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def load_sharded_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Copy a sharded (this rank's layout) or full optimizer state dict into the optimizer.

    Raises:
        KeyError: a parameter of the optimizer has no state in ``osd``; names it.
    """
    names = param_names(model)
    with torch.no_grad():
        for p, entry in optimizer.state.items():
            name = names.get(id(p))
            if name is None:
                continue
            if name not in osd["state"]:
                raise KeyError(f"optimizer state has no entry for parameter {name!r}")
            for key, value in osd["state"][name].items():
                current = entry.get(key)
                if not isinstance(current, torch.Tensor):
                    entry[key] = value
                    continue
                local = _local(value, _sharded(p), current)
                if local.numel() and local.data_ptr() == current.data_ptr():
                    continue  # loaded in place
                current.copy_(local.reshape(current.shape))
    for group, saved in zip(optimizer.param_groups, osd["param_groups"]):
        for k, v in saved.items():
            if k != "params":
                group[k] = v


def _local(value: Any, sp: Any, current: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``value`` for a state tensor shaped like ``current``."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if any(pl.is_shard() for pl in value.placements):
            return value.to_local()
        value = value.to_local()  # replicated: the whole value
    if _is_sharded_tensor(value):
        return _sharded_tensor_local(value, sp, current)
    value = torch.as_tensor(value)
    full_shaped = sp is not None and tuple(value.shape) == tuple(sp.spec.orig_shape)
    if full_shaped and tuple(current.shape) == tuple(sp.spec.local_shape):
        return sp.spec.local_slice(value)
    return value


def _is_sharded_tensor(value: Any) -> bool:
    # torch FSDP1's sharded optimizer state (what torch.distributed.checkpoint.optimizer's
    # load_sharded_optimizer_state_dict returns)
    return compat.is_sharded_tensor(value)


def _sharded_tensor_local(value: Any, sp: Any, current: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a ShardedTensor laid out as fullshard shards (torch.chunk along dim 0).

    Raises:
        ValueError: its local shard is not this rank's rows of the parameter.
    """
    shards = value.local_shards()
    start = sp.spec.local_row_start if sp is not None else 0
    if len(shards) == 1 and tuple(shards[0].tensor.shape) == tuple(current.shape):
        offsets = shards[0].metadata.shard_offsets
        if offsets[0] == start and not any(offsets[1:]):
            return shards[0].tensor
    if not shards and current.numel() == 0:
        return current.new_empty(current.shape)
    raise ValueError(
        f"optimizer state ShardedTensor of size {tuple(value.size())}: its local shards "
        f"{[tuple(s.metadata.shard_offsets) for s in shards]} are not this rank's rows {start}.."
        f"{start + current.shape[0] if current.dim() else start} (shape {tuple(current.shape)}); load it "
        "at the world size it was saved with"
    )


def full_optim_state_dict(
    model: nn.Module, optimizer: Optim, keep: bool = True, offload_to_cpu: bool = False
) -> dict[str, Any]:
    """The optimizer's state by parameter name with full tensors (collective).

    Every rank gathers each parameter's state in turn; with ``keep`` False a rank drops it at
    once (holding one parameter's state at a time) and returns an empty ``state``. With
    ``offload_to_cpu`` each value moves to CPU memory as soon as it is gathered. Values that
    need no gathering (``step``) are copied: the optimizer steps its own in place.
    """
    from torch.distributed.tensor import DTensor

    osd = sharded_optim_state_dict(model, optimizer)
    _mark_gathers([v for entry in osd["state"].values() for v in entry.values() if isinstance(v, DTensor)])
    state: dict[str, dict[str, Any]] = {}
    for name, entry in osd["state"].items():
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in entry.items()}
        if keep:
            state[name] = {k: _snapshot(entry[k], v, offload_to_cpu) for k, v in full.items()}
    return {"state": state, "param_groups": osd["param_groups"]}


def _mark_gathers(values: list[Any]) -> None:
    """Mark the start of the gathers of ``values`` (DTensors) on each of their groups, in order
    of first use: torch issues them, so the divergence check sees them only through this."""
    groups: dict[int, Any] = {}
    for v in values:
        for dim in range(v.device_mesh.ndim):
            group = v.device_mesh.get_group(dim)
            groups.setdefault(id(group), group)
    for group in groups.values():
        collectives.mark_start("optim_state_dict gather", group)


def _snapshot(before: Any, value: Any, offload_to_cpu: bool) -> Any:
    """``value`` (``before`` gathered) as a tensor the optimizer does not hold, on CPU if asked."""
    if not isinstance(value, torch.Tensor):
        return value
    device = torch.device("cpu") if offload_to_cpu else value.device
    return value.to(device, copy=value is before)


def to_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any], arg: str = "optim_state_dict"
) -> dict[str, Any]:
    """A name-keyed (full or sharded) optimizer state dict in torch's index-keyed form, this rank's rows.
    ``arg``: the caller's name for ``osd``, for the errors.

    Raises:
        KeyError: a parameter of ``optimizer`` is in no parameter group of ``osd`` (a dict saved
            from another model); names it. A parameter listed without state (it had no gradient
            before the save) is loaded without state, as torch's ``load_state_dict`` does.
        ValueError: ``osd`` has another number of parameter groups, or the optimizer holds
            parameters that are not the model's.
    """
    names = param_names(model)
    check_model_params(names, optimizer)
    if len(osd["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"{arg} has {len(osd['param_groups'])} parameter groups but optim has {len(optimizer.param_groups)}; "
            "build the optimizer with the same parameter groups as the one that saved it"
        )
    init_state(optimizer)  # its tensors tell which saved values are shard-shaped
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, saved in zip(optimizer.param_groups, osd["param_groups"]):
        ids = []
        listed = set(saved["params"])
        for p in group["params"]:
            name = names[id(p)]
            if name in osd["state"]:
                current = optimizer.state.get(p, {})
                state[index] = {
                    k: _local(v, _sharded(p), current[k]).clone() if isinstance(current.get(k), torch.Tensor) else v
                    for k, v in osd["state"][name].items()
                }
            elif p.requires_grad and osd["state"] and name not in listed:
                raise KeyError(
                    f"the optimizer state dict has no parameter {name!r} in its group: was it saved from this model "
                    "and optimizer?"
                )
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}
