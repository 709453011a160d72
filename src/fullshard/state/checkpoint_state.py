"""What a checkpoint holds and how it goes into a model: the sharded state of the model and its
optimizer, read into copies and checked against the checkpoint before anything is changed.

A load is all-or-nothing: the checkpoint's values are read into copies of the model's and the
optimizer's sharded state (:func:`copies`), after the keys, shapes and optimizer type were
compared with the checkpoint's (:func:`check_fits`); only when every rank has read everything
does :func:`apply` copy them in. Optimizer state that had to be created to be loaded into is
removed again when the load fails (:func:`create_optimizer_state`, :func:`forget_state`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullshard.engine.config import FrontEnd
from fullshard.engine.hooks import FSDPState, fsdp_state
from fullshard.engine.inference_guard import outside_inference_mode
from fullshard.state.checkpoint_errors import CheckpointMismatch
from fullshard.state.optim_state import (
    check_model_params,
    init_state,
    load_sharded_optim_state_dict,
    param_names,
    sharded_optim_state_dict,
)
from fullshard.state.state_dict import load_sharded_state_dict, sharded_state_dict


@outside_inference_mode
def sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The sharded state to save or load into: DTensor shards under the original names.

    A ``fully_shard`` model already registers DTensor parameters, so torch's own
    ``get_model_state_dict`` / ``get_optimizer_state_dict`` give it; the FSDP1 wrapper maps
    its plain shards itself. Both write the same keys, so ``convert`` reads either. Runs with
    inference mode off: optimizer state it creates before the first step (both front ends, as
    torch's ``get_optimizer_state_dict`` does) must not be inference tensors, which the next
    ``optimizer.step()`` could not update in place.

    Raises:
        TypeError: ``model`` heads no unit of either front end.
    """
    fsdp = fsdp_state_of(model)
    if fsdp.front_end is FrontEnd.FULLY_SHARD:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            check_model_params(param_names(model), optimizer)  # torch's says "KeyError: 0"
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        return state
    state = {"model": sharded_state_dict(model, fsdp.ignored)}
    if optimizer is not None:
        if not optimizer.state:
            # Saved before the first step: create the state as torch's get_optimizer_state_dict
            # does for fully_shard (a step with lr 0), so a load finds the keys it expects.
            init_state(optimizer)
        state["optim"] = sharded_optim_state_dict(model, optimizer)
    return state


def fsdp_state_of(model: nn.Module) -> FSDPState:
    """The FSDP state of the unit ``model`` heads (which front end built it, what it ignores).

    Raises:
        TypeError: ``model`` heads no unit.
    """
    state = fsdp_state(model) if isinstance(model, nn.Module) else None
    if state is None:
        raise TypeError(
            "model must be the root FullyShardedDataParallel or a module given to fully_shard, got "
            f"{type(model).__name__}"
        )
    return state


def create_optimizer_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Create the optimizer's state where it has none yet (a load needs tensors to load into);
    return the parameters whose state was created, for :func:`forget_state`."""
    if optimizer is None:
        return []
    before = {p for p, s in optimizer.state.items() if s}
    init_state(optimizer)
    return [p for g in optimizer.param_groups for p in g["params"] if p not in before and optimizer.state.get(p)]


def forget_state(optimizer: torch.optim.Optimizer | None, created: list[torch.Tensor]) -> None:
    """Remove the state :func:`create_optimizer_state` created: the optimizer is as it was."""
    if optimizer is not None:
        for p in created:
            optimizer.state.pop(p, None)


def apply(model: nn.Module, optimizer: torch.optim.Optimizer | None, target: dict[str, Any]) -> None:
    """Copy the loaded sharded state into the model and optimizer."""
    fsdp = fsdp_state_of(model)
    if fsdp.front_end is FrontEnd.FULLY_SHARD:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(model, target["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, target["optim"])
        return
    load_sharded_state_dict(model, target["model"], True, fsdp.ignored)
    if optimizer is not None:
        load_sharded_optim_state_dict(model, optimizer, target["optim"])


def copies(state: Any) -> Any:
    """The same nested state with every tensor (and DTensor shard) copied."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: copies(v) for k, v in state.items()}
    if isinstance(state, list):
        return [copies(v) for v in state]
    if isinstance(state, DTensor):
        return DTensor.from_local(
            state.to_local().clone(),
            state.device_mesh,
            state.placements,
            run_check=False,
            shape=state.size(),
            stride=state.stride(),
        )
    if isinstance(state, torch.Tensor):
        return state.clone()
    return state


def check_fits(saved: dict[str, Any], target: dict[str, Any], optimizer: Any, saved_optimizer: str | None) -> None:
    """Compare the checkpoint's keys and shapes (``saved``: its DCP metadata by key) with what
    the model and optimizer expect.

    Raises:
        CheckpointMismatch: missing or unexpected model keys and shape mismatches (all named);
            an optimizer whose state keys the checkpoint does not hold (the first missing key
            and both optimizer types named; another class with the same keys loads).
    """
    problems = _model_problems(saved, target["model"])
    if "optim" in target:
        problems += _optimizer_problems(saved, target["optim"], type(optimizer).__name__, saved_optimizer)
    if problems:
        raise CheckpointMismatch("; ".join(problems))


def _model_problems(saved: dict[str, Any], model_state: dict[str, Any]) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    wanted = {f"model.{name}": value for name, value in model_state.items()}
    saved_model = {k for k in saved if k.startswith("model.")}
    missing = sorted(set(wanted) - saved_model)
    unexpected = sorted(saved_model - set(wanted))
    problems = []
    if missing:
        problems.append(f"missing key(s) {', '.join(k[6:] for k in missing)}")
    if unexpected:
        problems.append(f"unexpected key(s) {', '.join(k[6:] for k in unexpected)}")
    for key, value in wanted.items():
        meta = saved.get(key)
        if isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            if tuple(meta.size) != tuple(value.size()):
                problems.append(
                    f"shape mismatch for {key[6:]}: checkpoint {tuple(meta.size)}, model {tuple(value.size())}"
                )
    return problems


def _optimizer_problems(saved: dict[str, Any], optim: dict[str, Any], mine: str, theirs: str | None) -> list[str]:
    if not any(k.startswith("optim.") for k in saved):
        return ["the checkpoint holds no optimizer state"]
    wanted = [f"optim.state.{name}.{key}" for name, entry in optim.get("state", {}).items() for key in entry]
    missing = [k for k in wanted if k not in saved]
    if not missing:  # another class with the same state (Adam and AdamW) loads
        return []
    held = f"{theirs} state" if theirs else "optimizer state of a type it does not record (saved without a manifest)"
    return [f"optimizer mismatch: the checkpoint holds {held}, the optimizer is {mine}; first missing key {missing[0]}"]
