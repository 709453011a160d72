"""The device meshes ``fully_shard`` shards over, and the groups it reshards to after forward.

Without a mesh, ``fully_shard`` shards over a 1-D mesh of the whole world, one per process
group and device type. ``reshard_after_forward=M`` (an int) keeps 1/M of the parameters after
forward: backward then all-gathers within groups of M consecutive ranks of the shard dimension.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from fullshard.comm import collectives

_DEFAULT_MESHES: dict[tuple[int, str], Any] = {}


def default_mesh(device_type: str) -> Any:
    """A 1-D DeviceMesh over the default group (one per process group and device type)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(collectives.default_group()), device_type)
    if key not in _DEFAULT_MESHES:
        _DEFAULT_MESHES[key] = init_device_mesh(device_type, (collectives.group_size(collectives.default_group()),))
    return _DEFAULT_MESHES[key]


def check_mesh(mesh: Any, argument: str) -> None:
    """Refuse a ``mesh`` / ``device_mesh`` argument that is neither None nor a DeviceMesh, or
    that leaves this rank out.

    Raises:
        TypeError: naming ``argument``, the expected type and the value given.
        ValueError: this rank is not in the mesh (on that rank only: the others may go on).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{argument} must be a torch.distributed.device_mesh.DeviceMesh (e.g. init_device_mesh('cpu', "
            f"(world_size,))) or None, got {type(mesh).__name__} {mesh!r}"
        )
    if mesh is not None and mesh.get_coordinate() is None:
        call = argument.split(":")[0]
        raise ValueError(
            f"{argument}: this rank ({collectives.group_rank(collectives.default_group())}) is not in the mesh (ranks "
            f"{mesh.mesh.flatten().tolist()}): call {call} only on the mesh's ranks, or pass a mesh of every rank "
            "that calls it"
        )


def mesh_device(mesh: Any) -> torch.device | None:
    """The compute device a mesh implies (CUDA's current device for a CUDA mesh)."""
    if mesh is None or mesh.device_type == "cpu":
        return None
    return (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )


def as_reshard_after_forward(value: Union[bool, int, None], shard_size: int) -> tuple[bool, int | None]:
    """FSDP2's ``reshard_after_forward`` as (reshard, size of the group to reshard to).

    A bool; None (True: the root keeps its parameters anyway); or an int M dividing the shard
    group's size: after forward each rank keeps 1/M of the parameters and backward all-gathers
    within a group of M ranks (1 keeps the full parameters, the shard group's size is True).

    Raises:
        ValueError: an int that does not divide the shard group's size, or another type.
    """
    if value is None or isinstance(value, bool):
        return (True if value is None else value), None
    if isinstance(value, int) and value >= 1:
        if shard_size % value:
            raise ValueError(
                f"fully_shard: reshard_after_forward={value} must divide the shard group's size ({shard_size}), "
                "as torch's: the number of ranks to reshard to after forward"
            )
        if value == 1:
            return False, None
        return True, (value if value != shard_size else None)
    raise ValueError(f"fully_shard: reshard_after_forward must be a bool, None or a positive int, got {value!r}")


# (id of the mesh, size) -> (the (-1, size) mesh, the mesh itself: kept alive, so that its id is
# never another mesh's; else a later mesh at the same address, of other ranks, got this group)
_POST_FORWARD_MESHES: dict[tuple[int, int], tuple[Any, Any]] = {}


def post_forward_group(mesh: Any, size: int) -> Any:
    """The group of ``size`` consecutive ranks of the mesh's shard dimension holding this rank
    (created collectively, once per mesh and size, as torch's: the mesh viewed as (-1, size))."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(mesh), size)
    if key not in _POST_FORWARD_MESHES:
        _POST_FORWARD_MESHES[key] = (DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size)), mesh)
    return _POST_FORWARD_MESHES[key][0].get_group(1)


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """torch 2.13's name for the data-parallel dimensions of a full SPMD mesh whose parameters
    are already DTensors on it (``fully_shard(mesh=full_mesh, dp_mesh_dims=...)``): ``shard``
    and ``replicate``, each a dimension name or a tuple of names to flatten.

    fullshard's ``fully_shard`` does not take it (see :func:`refuse_dp_mesh_dims`); it exists so
    that programs importing it from here get that error at the call, not an ImportError.

    Raises:
        ValueError: neither ``shard`` nor ``replicate`` is set.
    """

    shard: Optional[Union[str, tuple[str, ...]]] = None
    replicate: Optional[Union[str, tuple[str, ...]]] = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims: set shard, replicate or both (mesh dimension names)")


def refuse_dp_mesh_dims(dp_mesh_dims: Any) -> None:
    """``fully_shard``'s ``dp_mesh_dims``: only None is supported.

    Raises:
        NotImplementedError: any other value, saying what to pass instead.
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims={dp_mesh_dims!r}) is not supported by fullshard: pass the data-parallel "
            'slice as the mesh (mesh=full_mesh["dp_replicate", "dp_shard"]), with tensor-parallel DTensor '
            'parameters on another dimension of the same mesh (full_mesh["tp"]), as torch before 2.13 takes them'
        )
