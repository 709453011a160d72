"""Keeping a unit's registered shards and its local flat buffer one.

The engine reads and writes shards through the unit's local flat buffer (the all-gather input);
the program sees the registered parameters. They can part ways, and :func:`sync_shards` (run at
every unshard) brings them together again: a registered parameter replaced by another
(``load_state_dict(assign=True)``), a shard whose storage was replaced (``param.data = ...``,
``module.to_empty``, which swaps a DTensor's contents), and a unit built on the meta device
(``fully_shard`` of a model built under ``torch.device("meta")``), whose buffers are allocated
when its shards first hold real values. :func:`register_dtensors` gives ``fully_shard`` its
DTensor parameters. The vocabulary is :mod:`.layout`'s and :mod:`.sharded_param`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.comm import collectives, flight_recorder
from fullshard.comm.flight_recorder import REQUIRES_GRAD_CHECK
from fullshard.engine.layout import UnitLayout
from fullshard.engine.sharded_param import ShardedParam, local_tensor


def register_dtensors(
    unit: UnitLayout, mesh: Any, placements: Sequence[Any], specs: Mapping[str, Any] | None = None
) -> None:
    """Register every shard as a DTensor of the full shape on ``mesh`` with ``placements``
    (torch FSDP2's parameters); its local tensor is the same view of the local flat buffer.
    ``specs`` (fqn -> DTensorSpec) overrides that for some parameters (tensor-parallel ones,
    placed on the 2-D (dp, tp) mesh).
    """
    for sp in unit.params:
        shape = sp.spec.orig_shape
        stride = torch.empty(shape, device="meta").stride()
        sp.dtensor_spec = (specs or {}).get(sp.fqn) or compat.make_dtensor_spec(
            mesh, tuple(placements), shape, stride, unit.dtype
        )
        local = unit.local_view(sp)
        sp.register_shard(nn.Parameter(sp.as_registered(local), requires_grad=sp.requires_grad))


def replacement(sp: ShardedParam) -> torch.Tensor | None:
    """The parameter registered in ``sp``'s shard's place since it was last taken
    (``load_state_dict(assign=True)``), or None if the shard is still the one registered."""
    registered = compat.module_parameters(sp.slots[0].module).get(sp.slots[0].attr)
    if registered is None or registered is sp.shard or sp.swapped:
        return None
    return registered


def sync_shards(unit: UnitLayout) -> None:
    """Take back any shard whose storage was replaced (``param.data = ...``, ``to_empty``, a
    DTensor's local tensor swapped) or whose registered parameter was replaced
    (``load_state_dict(assign=True)``): copy its values into the local flat buffer and make
    it a view of that buffer again."""
    flipped = []  # parameters whose requires_grad changed since the unit was laid out
    for sp in unit.params:
        registered = replacement(sp)
        if registered is not None:
            check_replacement(unit, sp, registered)
            sp.register_shard(registered)  # type: ignore[arg-type]
        if _check_unchanged(unit, sp):
            flipped.append(sp)
    if unit.meta:
        unit.materialize()
    for sp, ptr in zip(unit.params, unit.shard_ptrs):
        if sp.swapped:
            continue
        local = sp.local
        if local.is_meta:
            continue
        if sp.spec.local_numel == 0:  # nothing to copy; a view again, as the ranks holding elements
            if _off_flat(unit, local):
                sp.point_at(unit.local_view(sp))
        elif local.data_ptr() != ptr:
            view = unit.local_view(sp)
            with torch.no_grad():
                view.copy_(local.detach().reshape(view.shape))
            sp.point_at(view)
    if flipped:
        _relayout(unit, flipped)
    elif unit.frozen_pending is not None:
        unit.frozen_pending = None  # unfrozen again before the reduction


def shards_version(unit: UnitLayout) -> int:
    """The sum of the version counters of ``unit``'s local flat buffer, its shards and their local
    tensors: it grows with every in-place change to them (an optimizer step, ``load_state_dict``, a
    write back into the shards), also to a shard whose counter is its own (a parameter registered in
    its place) and to a DTensor shard (an in-place op on a DTensor bumps its own counter, not its
    local tensor's), and to the plain stand-in an elementwise optimizer steps on (its counter stays
    the old local flat buffer's after a relayout). Changes through ``.data`` bump no counter (as
    autograd, it cannot see them)."""
    version = compat.version_counter(unit.local_flat)
    for sp in unit.params:
        local = sp.local
        version += compat.version_counter(local)
        if local is not sp.shard:
            version += compat.version_counter(sp.shard)  # type: ignore[arg-type]
        if sp.local_param is not None:  # the plain stand-in an elementwise optimizer steps on
            version += compat.version_counter(sp.local_param)
    return version


def shards_in_place(unit: UnitLayout) -> bool:
    """Whether :func:`sync_shards` would find nothing to do on ``unit``: every shard is the one
    laid out (registered, or shown in its place: ``FSDPModule.unshard`` registers the full
    parameters), still a view of the local flat buffer, of the unit's dtype and with the
    ``requires_grad`` the layout has; no parameter replaced, none waiting to be frozen."""
    if unit.meta or unit.frozen_pending is not None:
        return False
    for sp, ptr in zip(unit.params, unit.shard_ptrs):
        shard = sp.shard
        if shard is None or replacement(sp) is not None:
            return False
        if shard.requires_grad != sp.requires_grad or shard.dtype != unit.dtype:
            return False
        if sp.spec.local_numel > 0 and sp.local.data_ptr() != ptr:
            return False
        if sp.spec.local_numel == 0 and _off_flat(unit, sp.local):
            return False
    return True


def _off_flat(unit: UnitLayout, local: torch.Tensor) -> bool:
    """Whether the empty shard ``local`` (a rank holding none of its parameter's elements) no
    longer lies on ``unit``'s local flat buffer (``param.data = ...`` on every rank): its data
    pointer cannot tell, its storage can. The ranks holding elements see the same assignment by
    their data pointers, so every rank takes it back and gathers again, not only those."""
    return not local.is_meta and local.untyped_storage().data_ptr() != unit.local_flat.untyped_storage().data_ptr()


def requires_grad_changed(unit: UnitLayout) -> bool:
    """Whether a parameter's ``requires_grad`` changed since ``unit`` was laid out."""
    return any(_flipped(sp) for sp in unit.params)


def flipped_params(unit: UnitLayout) -> list[ShardedParam]:
    """The parameters whose ``requires_grad`` changed since ``unit`` was laid out."""
    return [sp for sp in unit.params if _flipped(sp)]


def _flipped(sp: ShardedParam) -> bool:
    return sp.shard is not None and not sp.swapped and sp.shard.requires_grad != sp.requires_grad


def check_relayout(unit: UnitLayout, flipped: list[ShardedParam]) -> None:
    """Raise if ``unit``, whose parameters ``flipped`` changed ``requires_grad``, cannot be laid
    out again now (for a change that cannot wait either: :meth:`~.layout.UnitLayout.defer_relayout`).

    Raises:
        RuntimeError: the unit cannot change now (:meth:`~.layout.UnitLayout.relayout_refusal`),
            naming the parameter, the moment and the fix.
    """
    _refuse(unit, flipped)


def _relayout(unit: UnitLayout, flipped: list[ShardedParam]) -> None:
    """Lay ``unit`` out again for its parameters' new ``requires_grad`` (torch's FSDP2 lets a
    program freeze and unfreeze parameters between steps).

    Raises:
        RuntimeError: as :func:`check_relayout`.
    """
    if unit.defer_relayout(flipped):
        return
    _refuse(unit, flipped)
    _check_same_on_every_rank(unit)
    unit.relayout_trainable()


def _check_same_on_every_rank(unit: UnitLayout) -> None:
    """Compare the parameters' new ``requires_grad`` across the unit's ranks (one small
    all-gather per group, at a relayout only): ranks laid out differently would exchange one
    parameter's values for another's, silently when the sizes agree.

    Raises:
        RuntimeError: on every rank of the group, when some rank's flags differ, naming the
            first parameter that differs and which ranks of the group have it trainable.
    """
    flags = [sp.shard is not None and sp.shard.requires_grad for sp in unit.params]
    for group in (unit.shard_group, unit.replicate_group):
        if group is None or collectives.group_size(group) == 1:
            continue
        n = collectives.group_size(group)
        mine = torch.tensor(flags, dtype=torch.uint8, device=collectives.reduction_device(group))
        every = torch.empty(n * len(flags), dtype=torch.uint8, device=mine.device)
        # Labelled: a rank whose requires_grad changed alone meets the others' next forward
        # all-gather here; the watchdog's divergence check names this phase (comm.divergence).
        with flight_recorder.at(unit.name, REQUIRES_GRAD_CHECK):
            collectives.all_gather(every, mine, group)
        rows = every.view(n, -1).cpu()
        differs = (rows != rows[0]).any(dim=0).nonzero()
        if len(differs):
            i = int(differs[0])
            trains = [r for r in range(n) if rows[r, i]]
            raise RuntimeError(
                f"FSDP unit {unit.name!r}: {unit.params[i].fqn}.requires_grad was changed on some ranks only (it "
                f"requires grad on ranks {trains} of {n} in the unit's group): every rank must change the same "
                "parameters, the unit's layout follows them"
            )


def _refuse(unit: UnitLayout, flipped: list[ShardedParam]) -> None:
    why = unit.relayout_refusal()
    if why is not None:
        sp = flipped[0]
        assert sp.shard is not None
        raise RuntimeError(
            f"FSDP unit {unit.name!r}: {sp.fqn}.requires_grad was set to {sp.shard.requires_grad} after sharding{why}"
        )


def _check_unchanged(unit: UnitLayout, sp: ShardedParam) -> bool:
    """What the unit fixed when it was built must not have changed since: the parameters'
    dtype (the local flat buffer's). Returns whether ``requires_grad`` changed (the packed
    gradient covers the trainable parameters alone: the caller lays the unit out again).

    Raises:
        RuntimeError: the dtype changed (``model.to(dtype)``), naming the parameter and the fix.
    """
    shard = sp.shard
    if shard is None or sp.swapped:
        return False
    flipped = shard.requires_grad != sp.requires_grad
    if shard.dtype != unit.dtype and not shard.is_meta:
        raise RuntimeError(
            f"FSDP unit {unit.name!r}: {sp.fqn} is {shard.dtype} but the unit was sharded in {unit.dtype} "
            "(model.to(dtype) after sharding is not supported): cast the model before sharding it, or compute "
            "in another dtype with mixed precision (MixedPrecisionPolicy / MixedPrecision)"
        )
    return flipped


def check_replacement(unit: UnitLayout, sp: ShardedParam, new: torch.Tensor) -> None:
    """A parameter put in a shard's place (``load_state_dict(assign=True)``) must be laid
    out like the shard: a DTensor on the unit's mesh with its placements (fully_shard), or
    a plain tensor of the shard's shape (the FSDP1 wrapper). Also for all-gather extension
    parameters (:mod:`.all_gather_extension`).

    Raises:
        ValueError: another mesh, placements or shape, naming the parameter and the fix.
    """
    spec = sp.dtensor_spec
    placements = getattr(new, "placements", None)
    if spec is not None and (
        getattr(new, "device_mesh", None) != spec.mesh or tuple(placements or ()) != spec.placements
    ):
        raise ValueError(
            f"FSDP unit {unit.name!r}: parameter {sp.fqn} was replaced by a "
            f"{type(new).__name__} on mesh {getattr(new, 'device_mesh', None)} with placements {placements}, "
            f"but the unit shards it over {spec.mesh} as {spec.placements}: build the value with "
            "distribute_tensor(full, param.device_mesh, param.placements) from the model's own parameter"
        )
    shape = tuple(new.shape) if spec is not None else tuple(local_tensor(new).shape)
    want = tuple(spec.shape) if spec is not None else tuple(sp.spec.local_shape)
    if shape != want:
        raise ValueError(
            f"FSDP unit {unit.name!r}: parameter {sp.fqn} was replaced by one of shape {shape}, expected {want}"
        )
