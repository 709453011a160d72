"""Full parameters on demand: FSDP1's ``summon_full_params``.

Inside the context every unit of the tree shows its full parameters (original shapes and
dtypes) through the Parameter objects registered for its shards; on exit the shards come back,
with changes to the full parameters copied into them when asked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fullshard.comm import flight_recorder
from fullshard.engine import hooks
from fullshard.engine.config import FrontEnd
from fullshard.engine.inference_guard import outside_inference_mode
from fullshard.engine.sharded_param import assign_grad
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
        for unit, shown in zip(units, summoned):
            if shown is None:
                continue
            full, hidden = shown
            if writeback:
                outside_inference_mode(unit.write_back)(full)
            for sp, (data, grad, was_swapped) in zip(unit.params, hidden):
                shard = sp.shard
                assert shard is not None
                shard.grad = None  # the full gradient first: .data and .grad must agree in shape
                shard.data = data
                assign_grad(shard, grad)  # a keep_low_precision_grads gradient differs in dtype
                sp.swapped = was_swapped  # an enclosing summon_full_params still shows its full tensor


def _wrapper_units(module: nn.Module) -> list[Unit]:
    """The units FullyShardedDataParallel wrappers head in ``module``'s tree, ``module``'s first."""
    return [
        h.unit for m in module.modules() if (h := hooks.fsdp_state(m)) is not None and h.front_end is FrontEnd.WRAPPER
    ]


# Each shard's data, gradient and ``swapped`` flag from before the context, restored after it.
Hidden = list[tuple[torch.Tensor, "torch.Tensor | None", bool]]


@flight_recorder.labelled("summon_full_params")
@outside_inference_mode
def _summon(
    unit: Unit, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> tuple[list[torch.Tensor], Hidden] | None:
    """Gather ``unit``'s parameters in full precision and show them through the registered
    Parameters themselves (their ``.data``, as torch's FSDP1 with use_orig_params=True: a
    reference taken before the context sees the full values too); the full tensors and what
    they hide, or None where skipped."""
    full = unit.gather_full(unit.local_flat)
    grads = unit.gather_full(unit.local_grads()) if with_grads else None  # zeros where None
    if rank0_only and not unit.first_data_parallel_rank:
        return None
    if offload_to_cpu:
        full = [t.cpu() for t in full]
        grads = [g.cpu() for g in grads] if grads is not None else None
    hidden: Hidden = []
    for i, (sp, value) in enumerate(zip(unit.params, full)):
        shard = sp.shard
        assert shard is not None
        hidden.append((shard.data, shard.grad, sp.swapped))
        shard.grad = None
        shard.data = value
        if grads is not None and sp.requires_grad and hidden[-1][1] is not None:
            assign_grad(shard, grads[i])
        sp.swapped = True  # its storage is not a replaced shard's (shard_sync leaves it)
    return full, hidden
