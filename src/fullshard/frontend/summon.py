"""Full parameters on demand: FSDP1's ``summon_full_params``.

Inside the context every unit of the tree holds its full parameters (original shapes and
dtypes) registered where its shards were; on exit the shards come back, with changes to the
full parameters copied into them when asked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fullshard.comm import flight_recorder
from fullshard.engine import hooks
from fullshard.engine.config import FrontEnd
from fullshard.engine.unit import TrainingState, Unit


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside the context, the modules hold full parameters (original shapes and dtypes).

    ``module.weight`` and ``parameters()`` give full tensors. With ``writeback``, changes to
    them are copied into the shards on exit. Collective: every rank enters it.

    Args:
        module: an FSDP module, or a module containing FSDP modules.
        recurse: include nested units (else only ``module``'s own unit).
        writeback: copy changes back to the shards on exit.
        rank0_only: only rank 0 (of the units' data-parallel ranks: on a slice of a mesh, each slice's
            first) materializes full parameters; other ranks keep shards.
        offload_to_cpu: put the full parameters in CPU memory.
        with_grads: also gather the gradients into the full parameters' ``.grad``.

    Raises:
        ValueError: ``writeback`` together with ``rank0_only``.
        RuntimeError: called during forward or backward.
    """
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(writeback=True, rank0_only=True) would lose other ranks' writes; "
            "pass writeback=False with rank0_only=True"
        )
    units = _wrapper_units(module)
    own = hooks.fsdp_state(module)
    if not recurse and own is not None and own.front_end is FrontEnd.WRAPPER:
        units = [own.unit]
    for unit in units:
        unit._check_state(TrainingState.IDLE, "summon full parameters")
    summoned = [_summon(unit, rank0_only, offload_to_cpu, with_grads) for unit in units]
    try:
        yield
    finally:
        for unit, full in zip(units, summoned):
            if writeback and full is not None:
                unit.write_back(full)
            for sp in unit.params:
                assert sp.shard is not None
                sp.register_shard(sp.shard)


def _wrapper_units(module: nn.Module) -> list[Unit]:
    """The units FullyShardedDataParallel wrappers head in ``module``'s tree, ``module``'s first."""
    return [
        h.unit for m in module.modules() if (h := hooks.fsdp_state(m)) is not None and h.front_end is FrontEnd.WRAPPER
    ]


@flight_recorder.labelled("summon_full_params")
def _summon(unit: Unit, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> list[torch.Tensor] | None:
    """Gather ``unit``'s parameters in full precision and register them; None where skipped."""
    full = unit.gather_full(unit.local_flat)
    grads = unit.gather_full(unit.local_grads()) if with_grads else None  # zeros where None
    if rank0_only and not unit.first_data_parallel_rank:
        return None
    if offload_to_cpu:
        full = [t.cpu() for t in full]
        grads = [g.cpu() for g in grads] if grads is not None else None
    for i, (sp, value) in enumerate(zip(unit.params, full)):
        param = nn.Parameter(value, requires_grad=sp.requires_grad)
        assert sp.shard is not None
        if grads is not None and sp.requires_grad and sp.shard.grad is not None:
            param.grad = grads[i]
        sp.swap_registered(param)
    return full
