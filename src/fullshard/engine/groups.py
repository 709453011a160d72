"""The process groups a unit shards and replicates over, from the front ends' arguments.

``process_group`` (a group, or a (shard, replicate) tuple for hybrid sharding), ``device_mesh``
(1-D, or 2-D (replicate, shard)) and the sharding strategy give a unit its shard group (the
ranks that split its parameters) and its replicate group (the ranks that hold the same shard and
all-reduce its gradients). A group of one rank is None: nothing to communicate over it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fullshard.comm import collectives, process_groups
from fullshard.engine.config import ShardingStrategy

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclasses.dataclass(frozen=True)
class Groups:
    """The groups a unit shards and replicates over (None: a group of one rank).

    Resolved once per front-end call; nested wrappers of an FSDP1 tree share the root's.
    """

    shard: collectives.ProcessGroup | None
    replicate: collectives.ProcessGroup | None
    broadcast_order: tuple[collectives.ProcessGroup, ...]  # sync_module_states: rank 0's values reach every rank


def resolve_groups(process_group: Any, device_mesh: Any, strategy: ShardingStrategy) -> Groups:
    """Shard and replicate groups from ``process_group`` / ``device_mesh`` and the strategy.

    Raises:
        ValueError: both given; a mesh or tuple that does not fit the strategy or the world size.
    """
    hybrid = strategy in _HYBRID
    if device_mesh is not None and process_group is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if device_mesh is not None:
        # A mesh may be a slice of a bigger one (mesh3["dp_replicate", "dp_shard"] next to "pp"):
        # its groups tile its own ranks by construction, whatever the world size.
        if device_mesh.ndim == 2 and hybrid:
            shard, replicate = device_mesh.get_group(1), device_mesh.get_group(0)
        elif device_mesh.ndim == 1 and not hybrid:
            return _flat(device_mesh.get_group(), strategy)
        else:
            raise ValueError(
                f"device_mesh has {device_mesh.ndim} dimension(s) but sharding_strategy={strategy.name} "
                "needs " + ("2: (replicate, shard), e.g. init_device_mesh('cuda', (2, 4))" if hybrid else "1")
            )
    elif isinstance(process_group, tuple):
        if not hybrid or len(process_group) != 2:
            raise ValueError(
                f"a process_group tuple means (shard_group, replicate_group) for HYBRID_SHARD or "
                f"_HYBRID_SHARD_ZERO2, not {strategy.name}"
            )
        shard, replicate = process_group
        _check_tuple_covers_world(shard, replicate)
    elif hybrid:
        shard, replicate = process_groups.hybrid_groups(process_groups.local_world_size())
    else:
        return _flat(process_group if process_group is not None else collectives.default_group(), strategy)
    return Groups(
        shard=shard if collectives.group_size(shard) > 1 else None,
        replicate=replicate if collectives.group_size(replicate) > 1 else None,
        broadcast_order=(shard, replicate),
    )


def _check_tuple_covers_world(shard: collectives.ProcessGroup, replicate: collectives.ProcessGroup) -> None:
    """A (shard, replicate) tuple must tile the world: nothing else says which ranks it spans.

    Raises:
        ValueError: replicate size x shard size is not the world size, naming both and the fix.
    """
    world = collectives.group_size(collectives.default_group())
    n_shard, n_replicate = collectives.group_size(shard), collectives.group_size(replicate)
    if n_shard * n_replicate != world:
        raise ValueError(
            f"process_group=(shard_group, replicate_group) covers {n_replicate} (replicate) x {n_shard} (shard) "
            f"ranks but the world size is {world}: pass groups that tile the world, or, for a part of it "
            "(beside pipeline stages), device_mesh=mesh['dp_replicate', 'dp_shard'] of one init_device_mesh"
        )


def regroup(groups: Groups, strategy: ShardingStrategy) -> Groups:
    """The groups of ``strategy`` over the same ranks as ``groups`` (a tree that is not hybrid):
    a unit whose wrap policy gives it another strategy than the root's (``CustomPolicy``).

    Raises:
        ValueError: either side is hybrid (its groups cannot be derived from the other's).
    """
    if strategy in _HYBRID or (groups.shard is not None and groups.replicate is not None):
        raise ValueError(
            f"a sharding_strategy of {strategy.name} for one unit of a tree sharded otherwise: hybrid strategies "
            "need the root's own (pass HYBRID_SHARD and a device_mesh to the root)"
        )
    return _flat(groups.broadcast_order[0], strategy)


def _flat(group: collectives.ProcessGroup, strategy: ShardingStrategy) -> Groups:
    if collectives.group_size(group) == 1:
        return Groups(None, None, (group,))
    if strategy is ShardingStrategy.NO_SHARD:
        return Groups(None, group, (group,))
    return Groups(group, None, (group,))
