"""Process groups: creating and destroying the default group, and the groups of hybrid sharding.

With :mod:`fullshard.comm.collectives`, the only code that calls torch.distributed.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from fullshard.comm import collectives, peers, quantized, watchdog
from fullshard.comm.buffers import POOL
from fullshard.comm.collectives import ProcessGroup, default_group, group_size, is_initialized


def local_world_size() -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE from the launcher, else the whole world."""
    import os

    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else group_size(default_group())


_HYBRID_CACHE: dict[int, tuple[ProcessGroup, ProcessGroup]] = {}


def hybrid_groups(shard_size: int) -> tuple[ProcessGroup, ProcessGroup]:
    """(shard group, replicate group) of this rank for consecutive shard groups of ``shard_size``.

    Shard group i holds ranks [i*S, (i+1)*S); replicate group j holds ranks j, j+S, j+2S, ...
    Collective: every rank creates every group in the same order. Cached per size.

    Raises:
        ValueError: ``shard_size`` does not divide the world size.
    """
    if shard_size in _HYBRID_CACHE:
        return _HYBRID_CACHE[shard_size]
    world, me = group_size(default_group()), dist.get_rank()
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"hybrid sharding: shard group size {shard_size} does not divide the world size {world}")
    shard = replicate = None
    for i in range(world // shard_size):
        g = dist.new_group(list(range(i * shard_size, (i + 1) * shard_size)))
        if i == me // shard_size:
            shard = g
    for j in range(shard_size):
        g = dist.new_group(list(range(j, world, shard_size)))
        if j == me % shard_size:
            replicate = g
    assert shard is not None and replicate is not None
    _HYBRID_CACHE[shard_size] = (shard, replicate)
    return shard, replicate


def init_process_group(
    backend_name: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    store_prefix: str,
    timeout_s: float,
    device_id: torch.device | None = None,
    host_store: bool = False,
) -> None:
    """Create the default process group on a TCPStore at ``master_addr:master_port`` under
    ``store_prefix``: the launcher's store, or with ``host_store`` one this process serves (rank 0
    when the launcher shares no store, as torch's ``env://`` does)."""
    # torch.distributed.nn.functional binds ``group.WORLD`` as default arguments when first
    # imported (optimizers and torch._dynamo import it). Imported after this point, it would
    # keep the default group, and gloo's threads, alive past destroy_process_group.
    import torch.distributed.nn.functional  # noqa: F401

    store = dist.TCPStore(master_addr, master_port, world_size, is_master=host_store)
    kwargs: dict[str, Any] = {}
    if device_id is not None:
        kwargs["device_id"] = device_id
    dist.init_process_group(
        backend_name,
        store=dist.PrefixStore(store_prefix, store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def destroy_process_group() -> None:
    """Destroy every process group and let gloo's worker threads end now.

    A gloo group's threads stop only when its last reference goes. Units reference their
    groups through cycles, so after the groups are unregistered a collection runs here: with
    the model already out of scope, the threads are joined now (see also
    :func:`init_process_group` for a reference torch itself can keep). Left to interpreter exit, a
    thread still releasing a finished collective's tensors needs the GIL while the
    interpreter is finalizing and aborts the process ("terminate called without an active
    exception"), roughly one run in six of a short job on this project's machine.
    """
    import gc

    if peers.STOP is None:
        watchdog.stop()
    # else the watchdog stopped this rank: a collective of the group may never complete (another rank
    # never issued it), so destroying the group can block until gloo's timeout. The watchdog keeps
    # running until exit (atexit), and ends the process after its grace period if it is still here.
    collectives.clear_caches()
    quantized.reset_generators()
    _HYBRID_CACHE.clear()
    POOL.clear()
    if is_initialized():
        dist.destroy_process_group()
    gc.collect()
