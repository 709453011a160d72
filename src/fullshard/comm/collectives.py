"""Collectives over flat 1-D buffers: the only module that calls torch.distributed.

Every function takes the process group explicitly and works on contiguous 1-D tensors.
It hides what differs between backends and torch versions:

- gloo has no ``ReduceOp.AVG``: averages are a sum followed by a division.
- gloo has no native reduce-scatter (torch emulates it with a full all-reduce). Here a
  reduce-scatter on gloo is an all-to-all of the N chunks followed by a local sum, which moves
  half the bytes.
- gloo's reduce-scatter at two ranks sends only the other rank's chunk and adds the received
  one to its own (an all-to-all with the own chunk left out).
- gloo's all-gather is about 3x slower than an all-to-all moving the same bytes (measured over
  loopback: 67 ms against 20 ms for a 24 MiB shard at 2 ranks, 136 ms against 45 ms at 3). Here
  an all-gather on gloo is N concurrent broadcasts, one rooted at each rank, straight into the
  output's slices; the bytes on the wire are the same. At two ranks it is one all-to-all with
  the own chunk left out (one gloo operation instead of two).
- torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
  ``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 has only the old names.

Asynchronous calls return a :class:`Handle`; its ``wait()`` finishes any local work (the sum
of an emulated reduce-scatter, the division of an average) and is idempotent.

While :mod:`fullshard.probes` are enabled, each call is counted there (calls, bytes sent).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fullshard import probes
from fullshard.comm.buffers import POOL

ProcessGroup = Any  # torch's ProcessGroup type moves between versions

_all_gather_fn: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_fn: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An in-flight collective. ``wait()`` blocks until it is done and runs its local epilogue.

    ``work`` is one torch Work (or Handle), a list of them (waited in order), or None.
    """

    def __init__(self, work: Any, epilogue: Callable[[], Any] | None = None) -> None:
        self._work = work
        self._epilogue = epilogue
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if isinstance(self._work, list):
            for w in self._work:
                w.wait()
        elif self._work is not None:
            self._work.wait()
        if self._epilogue is not None:
            self._epilogue()
        self._done = True


def _finish(work: Any, epilogue: Callable[[], Any] | None, async_op: bool) -> Handle | None:
    handle = Handle(work, epilogue)
    if async_op:
        return handle
    handle.wait()
    return None


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def default_group() -> ProcessGroup:
    """The default (world) process group. Raises RuntimeError if none is initialized."""
    if not is_initialized():
        raise RuntimeError(
            "fullshard needs an initialized process group: call "
            "torch.distributed.init_process_group(backend='gloo' on CPU or 'nccl' on CUDA) "
            "before wrapping, or pass process_group="
        )
    return dist.group.WORLD


def group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def backend(group: ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def reduction_device(group: ProcessGroup) -> torch.device:
    """Where tensors must live to be reduced over ``group``: the current GPU for NCCL, else CPU."""
    if backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Handle | None:
    """All-gather ``input`` (shape (S,)) from every rank into ``output`` (shape (N*S,)).

    Rank r's input lands in ``output[r*S:(r+1)*S]``. Both tensors are contiguous, same dtype
    and device. Returns a Handle when ``async_op``, else None after completion.
    """
    n = group_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected {n} x {input.numel()} (world size x input)"
        )
    if probes.ACTIVE is not None:
        probes.ACTIVE.collectives.record(
            "all_gather", input.dtype, input.numel(), input.numel() * input.element_size() * (n - 1)
        )
    if n > 1 and backend(group) == "gloo":
        rank = group_rank(group)
        slices = output.view(n, -1)
        if slices[rank].data_ptr() != input.data_ptr():
            slices[rank].copy_(input)
        if n == 2:
            # One all-to-all that sends our input to the other rank and receives its input
            # straight into its slice: one gloo operation instead of two broadcasts (1.5 MiB:
            # 1.06 ms against 1.29 ms on this project's machine).
            splits = [0, 0]
            splits[1 - rank] = input.numel()
            work = dist.all_to_all_single(slices[1 - rank], input, splits, splits, group=group, async_op=async_op)
            return _finish(work, None, async_op)
        # One broadcast rooted at each rank; the root sends its input as is, the others
        # receive into their slice of the output. Gloo runs them concurrently.
        works = [
            dist.broadcast(
                input if src == rank else slices[src], src=_global_ranks(group)[src], group=group, async_op=True
            )
            for src in range(n)
        ]
        return _finish(works, None, async_op)
    work = _all_gather_fn(output, input, group=group, async_op=async_op)
    return _finish(work if async_op else None, None, async_op)


_GLOBAL_RANKS: dict[Any, list[int]] = {}


def _global_ranks(group: ProcessGroup) -> list[int]:
    """Global rank of each rank of ``group``, in group-rank order (cached per group)."""
    ranks = _GLOBAL_RANKS.get(group)
    if ranks is None:
        ranks = [dist.get_global_rank(group, r) for r in range(group_size(group))]
        _GLOBAL_RANKS[group] = ranks
    return ranks


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup,
    divide_by: float = 1.0,
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``input`` (shape (N*S,)) over ranks and keep chunk r on rank r in ``output`` (S,).

    The result is the sum over ranks divided by ``divide_by`` (N for a mean: gloo has no AVG).
    On gloo this is an all-to-all of the N chunks plus a local sum.
    Returns a Handle when ``async_op``, else None after completion.
    """
    n = group_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected {n} x {output.numel()} (world size x output)"
        )
    nbytes = output.numel() * output.element_size() * (n - 1)
    if backend(group) == "gloo":
        if probes.ACTIVE is not None:
            probes.ACTIVE.collectives.record("reduce_scatter", input.dtype, input.numel(), nbytes)
        chunks = input.view(n, -1)
        if n == 2:
            # Send only the other rank's chunk and add the one that arrives to our own: no local
            # copy of our chunk, and a receive buffer of one chunk instead of two.
            me = group_rank(group)
            received = POOL.take(output.numel(), input.dtype, input.device)
            splits = [0, 0]
            splits[1 - me] = output.numel()
            work = dist.all_to_all_single(received, chunks[1 - me], splits, splits, group=group, async_op=async_op)

            def epilogue() -> None:
                torch.add(chunks[me], received, out=output)
                POOL.give(received)
                if divide_by != 1.0:
                    output.div_(divide_by)

            return _finish(work, epilogue, async_op)
        received = POOL.take(input.numel(), input.dtype, input.device)
        work = dist.all_to_all_single(received, input, group=group, async_op=async_op)

        def epilogue_n() -> None:
            torch.sum(received.view(n, -1), dim=0, out=output)
            POOL.give(received)
            if divide_by != 1.0:
                output.div_(divide_by)

        return _finish(work, epilogue_n, async_op)
    if probes.ACTIVE is not None:
        probes.ACTIVE.collectives.record("reduce_scatter", input.dtype, input.numel(), nbytes)
    work = _reduce_scatter_fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _finish(work, (lambda: output.div_(divide_by)) if divide_by != 1.0 else None, async_op)


def _staged(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``tensor`` itself when ``group`` can reduce it where it lives, else a copy on the device
    that can (a CPU scalar on an NCCL group: a loss sum, an error flag, a norm)."""
    device = reduction_device(group)
    return tensor if tensor.device == device else tensor.to(device)


def _copy_back(
    staged: torch.Tensor, tensor: torch.Tensor, then: Callable[[], Any] | None = None
) -> Callable[[], Any] | None:
    """The epilogue that returns a staged result to ``tensor`` (and runs ``then``), or ``then``."""
    if staged is tensor:
        return then

    def epilogue() -> None:
        tensor.copy_(staged)
        if then is not None:
            then()

    return epilogue


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup, divide_by: float = 1.0, async_op: bool = False
) -> Handle | None:
    """Sum ``tensor`` over ranks in place, then divide by ``divide_by``.

    A tensor on a device the group's backend cannot reduce on (a CPU tensor on an NCCL group) is
    reduced through a copy on the group's device and written back.
    """
    n = group_size(group)
    if probes.ACTIVE is not None:
        probes.ACTIVE.collectives.record(
            "all_reduce", tensor.dtype, tensor.numel(), 2 * tensor.numel() * tensor.element_size() * (n - 1) // n
        )
    staged = _staged(tensor, group)
    work = dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    divide = (lambda: tensor.div_(divide_by)) if divide_by != 1.0 else None
    return _finish(work, _copy_back(staged, tensor, divide), async_op)


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup) -> None:
    """Element-wise maximum over ranks, in place, synchronous (staged like :func:`all_reduce`)."""
    if probes.ACTIVE is not None:
        probes.ACTIVE.collectives.record(
            "all_reduce", tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size()
        )
    staged = _staged(tensor, group)
    dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=group)
    if staged is not tensor:
        tensor.copy_(staged)


def broadcast(tensor: torch.Tensor, src_rank: int, group: ProcessGroup) -> None:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank, in place, synchronous (staged
    like :func:`all_reduce`)."""
    if probes.ACTIVE is not None:
        probes.ACTIVE.collectives.record(
            "broadcast", tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size()
        )
    staged = _staged(tensor, group)
    dist.broadcast(staged, src=dist.get_global_rank(group, src_rank), group=group)
    if staged is not tensor:
        tensor.copy_(staged)


def all_gather_object(obj: Any, group: ProcessGroup) -> list[Any]:
    """Gather one picklable object per rank; returns the list in rank order."""
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src_rank: int, group: ProcessGroup) -> Any:
    """Send a picklable object from group rank ``src_rank`` to every rank; returns it on all
    (``obj`` is ignored on the other ranks)."""
    box = [obj if group_rank(group) == src_rank else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src_rank), group=group)
    return box[0]


def barrier(group: ProcessGroup) -> None:
    dist.barrier(group=group)


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

    _GLOBAL_RANKS.clear()
    _HYBRID_CACHE.clear()
    POOL.clear()
    if is_initialized():
        dist.destroy_process_group()
    gc.collect()
