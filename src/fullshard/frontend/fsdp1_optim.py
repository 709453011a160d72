"""FullyShardedDataParallel's optimizer state dicts under the state-dict type in force.

``FSDP.optim_state_dict`` and ``FSDP.optim_state_dict_to_load`` read the wrapper's
:class:`~fullshard.engine.config.StateDictSettings`: SHARDED_STATE_DICT gives DTensor shards,
the other types full tensors (on rank 0 only with ``rank0_only``, and sent from rank 0 when
loading). The mappings themselves are :mod:`fullshard.state.optim_state`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine import hooks
from fullshard.engine.config import StateDictSettings, StateDictType
from fullshard.frontend.options import warn_unused
from fullshard.state import optim_scatter, optim_state


def save(
    model: nn.Module,
    settings: StateDictSettings,
    optim: Any,
    optim_state_dict: dict[str, Any] | None,
    group: collectives.ProcessGroup | None,
) -> dict[str, Any]:
    """``optim``'s state (or ``optim_state_dict``, a state dict in ``optim``'s layout) keyed by name;
    ``{}`` on the ranks that ``rank0_only`` leaves out."""
    _check_optim(optim, "optim_state_dict")
    source: optim_state.Optim = optim
    if optim_state_dict is not None:
        source = optim_state.StateView(optim, optim_state_dict, "optim_state_dict")
    config = settings.optim_state_dict_config
    rank0_only = _rank0_only(settings)
    _warn_group(group, rank0_only, "optim_state_dict")
    if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
        warn_sharded_offload(model, config.offload_to_cpu, "optim_state_dict_config", stacklevel=3)
        return optim_state.sharded_optim_state_dict(model, source)
    keep = not rank0_only or collectives.group_rank(group if group is not None else collectives.default_group()) == 0
    osd = optim_state.full_optim_state_dict(model, source, keep=keep, offload_to_cpu=config.offload_to_cpu)
    return osd if keep else {}


def to_load(
    model: nn.Module,
    settings: StateDictSettings,
    optim: Any,
    optim_state_dict: dict[str, Any] | None,
    group: collectives.ProcessGroup | None,
) -> dict[str, Any]:
    """A name-keyed optimizer state dict as the id-keyed one ``optim.load_state_dict`` takes."""
    _check_optim(optim, "optim_state_dict_to_load")
    rank0_only = _rank0_only(settings)
    _warn_group(group, rank0_only, "optim_state_dict_to_load")
    if rank0_only:
        send_over = group if group is not None else collectives.default_group()
        optim_state_dict = optim_scatter.scatter(optim_state_dict, model, send_over, "optim_state_dict")
    else:
        optim_state.check_osd(optim_state_dict, "optim_state_dict")
    assert optim_state_dict is not None
    return optim_state.to_load(model, optim, optim_state_dict)


def warn_sharded_offload(model: nn.Module, offload_to_cpu: bool, arg: str, stacklevel: int) -> None:
    """Warn when a sharded state dict is asked to offload values that stay on a GPU.

    ``stacklevel``: as for :func:`~fullshard.frontend.options.warn_unused`.
    """
    if offload_to_cpu and any(
        h.unit.device.type != "cpu" and not h.unit.config.offload
        for m in model.modules()
        if (h := hooks.fsdp_state(m)) is not None
    ):
        warn_unused(
            f"{arg}.offload_to_cpu=True under SHARDED_STATE_DICT",
            "sharded values are DTensors over the shards themselves, which stay on their device",
            stacklevel + 1,
        )


def _rank0_only(settings: StateDictSettings) -> bool:
    """Whether full optimizer state goes to (and comes from) rank 0 only."""
    sharded = settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
    return not sharded and bool(getattr(settings.optim_state_dict_config, "rank0_only", False))


def _warn_group(group: Any, rank0_only: bool, caller: str) -> None:
    if group is not None and not rank0_only:
        warn_unused(
            f"{caller}(group=...)",
            "each FSDP unit gathers over its own process group; group= only picks rank 0 under rank0_only",
            4,
        )


def _check_optim(optim: Any, caller: str) -> None:
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"{caller}: optim must be a torch.optim.Optimizer, got {type(optim).__name__}; pass the optimizer "
            "built on the wrapped model's parameters"
        )
