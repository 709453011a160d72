"""torch's ``torch.distributed.checkpoint.state_dict`` functions on fullshard's FSDP1 wrapper.

torch's ``get_state_dict`` / ``set_state_dict`` (and the model- and optimizer-only variants)
find FSDP1 modules by asking torch's ``FullyShardedDataParallel`` class, which knows only its own
instances. On fullshard's wrapper they took it for a plain module: ``optim.state_dict()``'s rows
came back as if they were whole tensors, so a DCP checkpoint kept one rank's rows under each
name and silently lost the others' (``full_state_dict=True`` returned this rank's rows too).

:func:`install` (called when the first wrapper is built) puts :class:`EitherFSDP` in the place
where that module looks up torch's class: it answers for fullshard's wrappers with the wrapper's
own ``state_dict_type`` / ``optim_state_dict`` / ``optim_state_dict_to_load`` (whose sharded
state is DTensors, which DCP saves and reshards), and hands everything else to torch's class
unchanged, so torch's own FSDP1 keeps working in the same process. A model holding wrappers of
both kinds is refused.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

from fullshard import compat, deferred_import
from fullshard.engine.config import ShardingStrategy
from fullshard.frontend import fsdp1_state_dict

DSD_MODULE = "torch.distributed.checkpoint.state_dict"
HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_installed = False


def _torch_fsdp() -> Any:
    from torch.distributed.fsdp import fully_sharded_data_parallel

    return fully_sharded_data_parallel.FullyShardedDataParallel


def _ours(module: nn.Module) -> bool:
    """Whether ``module``'s tree holds fullshard wrappers (and, checked, none of torch's)."""
    mine = bool(fsdp1_state_dict.wrappers(module))
    if mine and _torch_fsdp().fsdp_modules(module):
        raise ValueError(
            f"{DSD_MODULE}: the model holds both fullshard's and torch's FullyShardedDataParallel "
            "modules; wrap it with one of them"
        )
    return mine


class _EitherFSDPMeta(type):
    """``isinstance(x, EitherFSDP)`` holds for fullshard's wrappers and torch's; attributes the
    stand-in does not define are torch's class's."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (fsdp1_state_dict.StateDictMethods, _torch_fsdp()))

    def __getattr__(cls, name: str) -> Any:
        return getattr(_torch_fsdp(), name)


class EitherFSDP(metaclass=_EitherFSDPMeta):
    """Stands for torch's ``FullyShardedDataParallel`` in torch's DCP state-dict module: each
    static method serves fullshard's wrappers with fullshard's implementation and any other
    model with torch's.

    Raises:
        ValueError: a model holds fullshard's and torch's FSDP1 wrappers both.
    """

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[Any]:
        """fullshard's wrappers in ``module``'s tree if it has any, else torch's FSDP modules."""
        if _ours(module):
            return list(fsdp1_state_dict.wrappers(module, root_only))
        return list(_torch_fsdp().fsdp_modules(module, root_only))

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
        """The state-dict type in force within the block (fullshard's for its wrappers).

        torch's functions pass torch's sharded configs with ``_use_dtensor=False`` (ShardedTensor
        values), which fullshard warns about when a user passes it; here the DTensors fullshard
        gives are what those functions handle, so that warning is not raised."""
        if not _ours(module):
            with _torch_fsdp().state_dict_type(module, *args, **kwargs):
                yield
            return
        with contextlib.ExitStack() as stack:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*_use_dtensor", category=UserWarning)
                stack.enter_context(fsdp1_state_dict.StateDictMethods.state_dict_type(module, *args, **kwargs))
            yield

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: Any, optim_state_dict: Any = None, group: Any = None) -> Any:
        """The name-keyed optimizer state (fullshard's: full tensors, or DTensor shards)."""
        if not _ours(model):
            return _torch_fsdp().optim_state_dict(model, optim, optim_state_dict, group)
        return fsdp1_state_dict.StateDictMethods.optim_state_dict(model, optim, optim_state_dict, _group(model, group))

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: Any, optim_state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """``optim_state_dict`` turned into the id-keyed dict ``optim.load_state_dict`` takes."""
        if not _ours(model):
            return _torch_fsdp().optim_state_dict_to_load(model, optim, optim_state_dict, *args, **kwargs)
        kwargs["group"] = _group(model, kwargs.get("group"))
        return fsdp1_state_dict.StateDictMethods.optim_state_dict_to_load(
            model, optim, optim_state_dict, *args, **kwargs
        )


def _group(model: nn.Module, group: Any) -> Any:
    """torch's DCP functions pass the wrapper's own process group on every call; fullshard's
    optimizer functions use ``group`` only to pick rank 0 under ``rank0_only`` (and warn
    otherwise), so it is passed on only then. For a hybrid wrapper torch's functions pass no
    group (rank 0 is the world's); they tell it by torch's ShardingStrategy, which fullshard's
    wrapper does not return, so they would pass its shard group (one "rank 0" per replica)."""
    wrappers = fsdp1_state_dict.wrappers(model)
    if not wrappers or not getattr(wrappers[0]._settings().optim_state_dict_config, "rank0_only", False):
        return None
    return None if wrappers[0].sharding_strategy in HYBRID_STRATEGIES else group


def _fully_sharded_state(module: nn.Module) -> Any:
    """For torch's check that every FSDP module found carries FSDP state: a fullshard wrapper
    is its own (as torch's wrapper is)."""
    if isinstance(module, fsdp1_state_dict.StateDictMethods):
        return module
    return compat.dsd_torch_fully_sharded_state(module)


def install() -> None:
    """Make torch's DCP state-dict functions serve fullshard's wrappers (idempotent; deferred
    until ``torch.distributed.checkpoint.state_dict`` is imported if it is not yet)."""
    global _installed
    if _installed:
        return
    _installed = True
    deferred_import.after_import(DSD_MODULE, lambda: compat.bind_dsd_fsdp(EitherFSDP, _fully_sharded_state))
