"""Tensor-parallel parameters under ``fully_shard``: (dp, tp) sharding, as torch's FSDP2 does.

After ``parallelize_module(block, mesh["tp"], ...)`` some parameters are DTensors on a 1-D
tensor-parallel mesh; each rank holds their **TP-local** tensor (its ColwiseParallel rows,
RowwiseParallel columns, or the whole of a Replicate bias). ``fully_shard(block,
mesh=mesh["dp"])`` shards that TP-local tensor over dp like any plain parameter (dim 0, torch.chunk
layout), so the engine's flat buffers hold plain local-of-local shards and its all-gather over dp
gives back the TP-local tensor. The dp mesh may also be 2-D, (replicate, shard) for hybrid
sharding (torchtitan's ``mesh["dp_replicate", "dp_shard"]``): the TP-local tensor is sharded over
the shard dimension and its gradient all-reduced over the replicate one, as for a plain parameter.

- forward sees it as a DTensor on the tp mesh with the TP placements
  (:meth:`~fullshard.engine.sharded_param.ShardedParam.unsharded`), so TP's own collectives run,
  and its gradient comes back as the TP-local gradient, which is reduce-scattered over dp;
- the registered parameter (and its gradient, and optimizer state) is a DTensor of the TP
  parameter's global shape on the mesh ``DeviceMesh._concatenate([dp, tp])`` (2-D, or 3-D
  (replicate, shard, tp) for a hybrid dp mesh) with placements ``([Replicate(),] dp placement,
  *tp placements)``: ``Shard(0)`` over dp, or ``_StridedShard(0, split_factor=tp)`` when TP also
  splits dim 0 (the dp shards then interleave with the tp shards). These are torch's placements,
  so ``clip_grad_norm_``, ``full_tensor()`` and torch.distributed.checkpoint treat the parameter
  as torch's FSDP2 + TP does, and checkpoints reshard between the two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.engine import build
from fullshard.engine.sharded_param import ShardedParam, is_sharded
from fullshard.engine.unit import Unit


def take_tp_params(holder: nn.Module, dp_mesh: Any) -> bool:
    """Replace every unsharded DTensor parameter of ``holder``'s unit region by a plain
    Parameter holding its local tensor, tagged with its DTensorSpec for the engine.

    Returns:
        whether there was any.

    Raises:
        NotImplementedError: a DTensor on a mesh of more than one dimension, or with placements
            other than Shard / Replicate.
        ValueError: a DTensor on another device type than ``dp_mesh``, or on a mesh that does not
            make one mesh with ``dp_mesh`` (e.g. fully_shard's default mesh of the whole world).
    """
    from torch.distributed.tensor import DTensor

    slots: list[tuple[nn.Module, str, str, Any]] = [
        (m, name, prefix + name, p)
        for prefix, m in build.walk_region(holder, frozenset())
        for name, p in compat.module_parameters(m).items()
        if isinstance(p, DTensor) and not is_sharded(p) and not hasattr(p, "_fullshard_ignored")
    ]
    for _, _, fqn, p in slots:  # all checked before any is replaced
        _check_tp(fqn, p, dp_mesh)
    plain: dict[int, nn.Parameter] = {}
    for m, name, _, p in slots:
        if id(p) not in plain:
            local = nn.Parameter(compat.dtensor_local(p).detach(), requires_grad=p.requires_grad)
            local._fullshard_tp_spec = compat.dtensor_spec(p)  # type: ignore[attr-defined]  # read by the engine's layout
            plain[id(p)] = local
        compat.module_parameters(m)[name] = plain[id(p)]
    return bool(plain)


def _check_tp(name: str, p: Any, dp_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = p.device_mesh, p.placements
    if mesh.ndim != 1 or not all(type(pl) in (Shard, Replicate) for pl in placements):
        raise NotImplementedError(
            f"fully_shard: parameter {name!r} is a DTensor on a {mesh.ndim}-D mesh with placements {placements}; "
            "fullshard composes with 1-D tensor parallelism (Shard or Replicate placements, e.g. "
            "parallelize_module(block, mesh['tp'], {...: ColwiseParallel(), ...: RowwiseParallel()}))"
        )
    if mesh.device_type != dp_mesh.device_type:
        raise ValueError(
            f"fully_shard: parameter {name!r} lives on a {mesh.device_type} mesh but fully_shard's mesh is "
            f"{dp_mesh.device_type}: build both from one init_device_mesh"
        )
    _spmd_mesh(dp_mesh, mesh, name)


def spmd_specs(unit: Unit, dp_mesh: Any) -> dict[str, Any]:
    """fqn -> the DTensorSpec of the registered parameter for each tensor-parallel parameter
    of ``unit``: the TP global shape on the (dp, tp) mesh (([replicate,] shard, tp) for a 2-D dp
    mesh), torch's placements.

    Raises:
        fullshard.compat.MissingTorchName: this torch has no ``DeviceMesh._concatenate`` (needed to
            build the 2-D mesh).
    """
    specs: dict[str, Any] = {}
    for sp in unit.params:
        tp = sp.tp_spec
        if tp is None:
            continue
        mesh = _spmd_mesh(dp_mesh, tp.mesh, sp.fqn)
        placements = (*_replicate_placements(dp_mesh), _dp_placement(tp), *tp.placements)
        specs[sp.fqn] = compat.make_dtensor_spec(mesh, placements, tp.shape, tp.stride, unit.dtype)
    return specs


def _replicate_placements(dp_mesh: Any) -> tuple[Any, ...]:
    """(Replicate(),) for the replicate dimension of a 2-D (hybrid) dp mesh, else ()."""
    from torch.distributed.tensor import Replicate

    return (Replicate(),) if dp_mesh.ndim == 2 else ()


def _dp_placement(tp: Any) -> Any:
    """Shard(0) over dp, or _StridedShard(0, split_factor=tp shards of dim 0) when TP splits dim 0."""
    from torch.distributed.tensor import Shard

    split = 1
    for i, pl in enumerate(tp.placements):
        if isinstance(pl, Shard) and pl.dim % len(tp.shape) == 0:
            split *= tp.mesh.size(i)
    if split == 1:
        return Shard(0)
    return compat.strided_shard(0, split)


_SPMD_MESHES: dict[tuple[int, int], Any] = {}


def _spmd_mesh(dp_mesh: Any, tp_mesh: Any, name: str = "") -> Any:
    """The (dp, tp) mesh, one per pair of meshes: 2-D, or 3-D (replicate, shard, tp) for a 2-D dp mesh.

    Raises:
        ValueError: the two are not distinct dimensions of one device mesh.
        fullshard.compat.MissingTorchName: this torch has no ``DeviceMesh._concatenate``.
    """
    key = (id(dp_mesh), id(tp_mesh))
    if key not in _SPMD_MESHES:
        concatenate = compat.concatenate_meshes_fn()  # outside the try: a torch without it raises MissingTorchName
        try:
            both = concatenate([dp_mesh, tp_mesh])
        except Exception as e:  # torch's own message is an internal invariant
            raise ValueError(
                f"fully_shard: parameter {name!r} is a DTensor on {tp_mesh}, which with fully_shard's mesh "
                f"{dp_mesh} does not make one mesh: build one mesh = init_device_mesh(device, (dp, tp), "
                "mesh_dim_names=('dp', 'tp')), parallelize over mesh['tp'] and pass fully_shard(..., mesh=mesh['dp']) "
                "(for hybrid sharding: dims ('dp_replicate', 'dp_shard', 'tp') and "
                "mesh=mesh['dp_replicate', 'dp_shard'])"
            ) from e
        _SPMD_MESHES[key] = (both, dp_mesh, tp_mesh)  # keeps both alive, so the ids stay theirs
    return _SPMD_MESHES[key][0]


def tp_local(sp: ShardedParam, value: torch.Tensor) -> torch.Tensor:
    """This rank's TP-local part of ``value``, a full tensor of the TP parameter's global shape
    (the slice its tp placements give this rank; a view)."""
    tp = sp.tp_spec
    shape, offset = compat.local_shape_and_offset(tp.shape, tp.mesh, tp.placements)
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
