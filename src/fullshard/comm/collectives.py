"""Collectives over flat 1-D buffers: the only module that calls torch.distributed.

Every function takes the process group explicitly and works on contiguous 1-D tensors.
It hides what differs between backends and torch versions:

- gloo has no ``ReduceOp.AVG``: averages are a sum followed by a division.
- gloo has no native reduce-scatter (torch emulates it with a full all-reduce). Here a
  reduce-scatter on gloo is an all-to-all of the N chunks followed by a local sum, which moves
  half the bytes.
- gloo's reduce-scatter at two ranks sends only the other rank's chunk, receives straight into
  the output and adds its own chunk there (an all-to-all with the own chunk left out, and no
  receive buffer: issue 33 measured the buffers kept for it at 149 MiB per rank on the 167M GPT).
  Given the own chunk of its input as the output it sums in place, the other chunk sent in
  pieces, each received where the one before it was sent from (issue 33: the root's gradient
  shards then need no buffer of their own, 125 MiB per rank on the 167M GPT).
- gloo's all-gather is about 3x slower than an all-to-all moving the same bytes (measured over
  loopback: 67 ms against 20 ms for a 24 MiB shard at 2 ranks, 136 ms against 45 ms at 3). Here
  an all-gather on gloo is N concurrent broadcasts, one rooted at each rank, straight into the
  output's slices; the bytes on the wire are the same. At two ranks it is one all-to-all with
  the own chunk left out (one gloo operation instead of two).
- :func:`all_to_all` exchanges equal parts with the other ranks (the own part stays home): the
  quantized collectives of :mod:`fullshard.comm.quantized` send int8 blocks through it and sum
  them locally, since an int8 sum on the wire would overflow.
- torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
  ``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 has only the old names
  (:mod:`fullshard.compat` picks one at import).

Asynchronous calls return a :class:`~fullshard.comm.handle.Handle`; its ``wait()`` finishes any
local work (the sum of an emulated reduce-scatter, the division of an average) and is
idempotent. On gloo every call is asynchronous underneath, so that a synchronous one also waits
through a Handle (in slices while the watchdog runs, see :mod:`fullshard.comm.handle`).

While the watchdog runs (:mod:`fullshard.comm.watchdog`), each call is checked against the other
ranks' before it reaches the backend when it is not the one this rank predicted
(:mod:`fullshard.comm.divergence`).

While :mod:`fullshard.probes` are enabled, each call is counted there (calls, bytes sent).
Collectives through a user's comm object (FSDP2's custom all-gather / reduce-scatter) are
:mod:`fullshard.comm.custom_collectives`'s, counted and recorded by this module's helpers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fullshard import compat, probes
from fullshard.comm import exposed_comm, flight_recorder, watchdog
from fullshard.comm.buffers import POOL
from fullshard.comm.flight_recorder import RECORDER, Entry
from fullshard.comm.handle import Handle
from fullshard.comm.handle import explained as _explained
from fullshard.comm.in_place import InPlaceExchange, is_own_chunk
from fullshard.comm.peers import CollectiveDiverged, CollectiveError, CollectiveFailed, CollectiveTimeout

ProcessGroup = Any  # torch's ProcessGroup type moves between versions

_all_gather_fn: Callable[..., Any] = compat.all_gather_tensor
_reduce_scatter_fn: Callable[..., Any] = compat.reduce_scatter_tensor

__all__ = ["CollectiveDiverged", "CollectiveError", "CollectiveFailed", "CollectiveTimeout", "Handle"]


def _unit() -> str | None:
    return RECORDER.context.unit


def _note(op: str, dtype: torch.dtype, numel: int, nbytes: int, group: ProcessGroup) -> Entry | None:
    """Count a collective in the probes and record it in the flight recorder (issued)."""
    if probes.ACTIVE is not None:
        probes.ACTIVE.collectives.record(op, dtype, numel, nbytes)
    return _checked(RECORDER.issue(op, dtype, numel, nbytes, _group_name(group)))


def _checked(entry: Entry | None) -> Entry | None:
    """``entry`` (just issued), after the divergence check (starting the watchdog if wanted)."""
    if watchdog.ACTIVE is None:
        if entry is None or not watchdog.wanted():
            return entry
        _start_watchdog()
    guard = watchdog.GUARD
    if entry is not None and guard is not None:
        guard.check(entry)  # raises before the backend sees a collective another rank did not issue
    return entry


def mark_start(phase: str, group: ProcessGroup) -> None:
    """Record that every rank of ``group`` starts ``phase``, whose collectives torch issues, not
    fullshard (DTensor's ``full_tensor()``): with the watchdog on, a rank that starts it alone is
    named by the divergence check (a "start" entry at once, not a timeout inside torch). Nothing
    goes to the backend. Call it on every rank of ``group``, outside the training loop's hot path."""
    with flight_recorder.at(phase=phase):
        entry = _checked(RECORDER.issue("start", torch.uint8, 0, 0, _group_name(group)))
    RECORDER.complete(entry)


def _start_watchdog() -> None:
    """Start the watchdog on the default process group's store (:func:`fullshard.compat.group_store`)."""
    world = default_group()
    store = compat.group_store(world)
    watchdog.start(store, dist.get_rank(), dist.get_world_size(), process_group_timeout(world))


def process_group_timeout(group: ProcessGroup) -> float:
    """The ``timeout=`` (seconds) that ``group`` was created with.

    torch has no public getter (:func:`fullshard.compat.backend_timeout` reads the backend's
    options). For a backend that keeps no options (a third-party one), torch's default
    (``torch.distributed.constants.default_pg_timeout``).
    """
    seconds = compat.backend_timeout(group, reduction_device(group))
    return float(dist.constants.default_pg_timeout.total_seconds()) if seconds is None else seconds


def _asynchronous(async_op: bool, group: ProcessGroup) -> bool:
    """Whether to issue a call asynchronously: when asked, and on gloo while the watchdog runs (a
    synchronous call would block in torch's C++ out of its reach; the Handle waits in slices)."""
    return async_op or (watchdog.ACTIVE is not None and backend(group) == "gloo")


def _finish(
    work: Any, epilogue: Callable[[], Any] | None, async_op: bool, entry: Entry | None, sliced: bool = False
) -> Handle | None:
    handle = Handle(work, epilogue, entry, sliced)
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


def is_group(obj: Any) -> bool:
    """Whether ``obj`` is a torch ProcessGroup."""
    return isinstance(obj, dist.ProcessGroup)


def is_outside(obj: Any) -> bool:
    """Whether ``obj`` is what ``torch.distributed.new_group`` returns to a rank not in the group."""
    return obj is dist.GroupMember.NON_GROUP_MEMBER


def group_size(group: ProcessGroup) -> int:
    """The number of ranks in ``group``. Raises RuntimeError when no process group is initialized."""
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank within ``group`` (0 to size - 1; -1 when it is not a member).

    Raises:
        RuntimeError: no process group is initialized.
    """
    return dist.get_rank(group)


def backend(group: ProcessGroup) -> str:
    """``group``'s backend name, lower case ("gloo", "nccl")."""
    return _facts(group).backend


class _Facts:
    """What fullshard looks up about a group on every collective, cached. The cache holds the
    group weakly: a group torch destroys (``torch.distributed.destroy_process_group``, as
    torchtitan calls it) must not live on here until interpreter exit, where its gloo threads
    would be joined while Python is finalizing."""

    __slots__ = ("ref", "backend", "ranks", "name")

    def __init__(self, group: ProcessGroup) -> None:
        self.ref = weakref.ref(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self.name = ",".join(map(str, self.ranks))  # the flight recorder's group key


_FACTS: dict[int, _Facts] = {}


def _facts(group: ProcessGroup) -> _Facts:
    facts = _FACTS.get(id(group))
    if facts is None or facts.ref() is not group:
        facts = _FACTS[id(group)] = _Facts(group)
    return facts


def reduction_device(group: ProcessGroup) -> torch.device:
    """Where tensors must live to be reduced over ``group``: the current GPU for NCCL, else CPU."""
    if backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@exposed_comm.blocking("all_gather", _unit)
@_explained
def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, async_op: bool = False, fill_own: bool = True
) -> Handle | None:
    """All-gather ``input`` (shape (S,)) from every rank into ``output`` (shape (N*S,)).

    Rank r's input lands in ``output[r*S:(r+1)*S]``. Both tensors are contiguous, same dtype
    and device. ``fill_own=False``: on gloo this rank's own slice of ``output`` is left as it
    is (a caller that needs its own shard elsewhere skips that copy); other backends write
    every slice regardless. Returns a Handle when ``async_op``, else None after completion.
    """
    n = group_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected {n} x {input.numel()} (world size x input)"
        )
    entry = _note("all_gather", input.dtype, input.numel(), input.numel() * input.element_size() * (n - 1), group)
    if n > 1 and backend(group) == "gloo":
        rank = group_rank(group)
        slices = output.view(n, -1)
        if fill_own and slices[rank].data_ptr() != input.data_ptr():
            slices[rank].copy_(input)
        if n == 2:
            # One all-to-all that sends our input to the other rank and receives its input
            # straight into its slice: one gloo operation instead of two broadcasts (1.5 MiB:
            # 1.06 ms against 1.29 ms on this project's machine).
            splits = [0, 0]
            splits[1 - rank] = input.numel()
            work = dist.all_to_all_single(
                slices[1 - rank], input, splits, splits, group=group, async_op=_asynchronous(async_op, group)
            )
            return _finish(work, None, async_op, entry, sliced=True)
        # One broadcast rooted at each rank; the root sends its input as is, the others
        # receive into their slice of the output. Gloo runs them concurrently.
        works = [
            dist.broadcast(
                input if src == rank else slices[src], src=_global_ranks(group)[src], group=group, async_op=True
            )
            for src in range(n)
        ]
        return _finish(works, None, async_op, entry, sliced=True)
    work = _all_gather_fn(output, input, group=group, async_op=async_op)
    return _finish(work if async_op else None, None, async_op, entry)


def _group_name(group: ProcessGroup) -> str:
    """The group's global ranks, comma-separated (the flight recorder's group key)."""
    return _facts(group).name


def _global_ranks(group: ProcessGroup) -> list[int]:
    """Global rank of each rank of ``group``, in group-rank order."""
    return _facts(group).ranks


@exposed_comm.blocking("reduce_scatter", _unit)
@_explained
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup,
    divide_by: float = 1.0,
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``input`` (shape (N*S,)) over ranks and keep chunk r on rank r in ``output`` (S,).

    The result is the sum over ranks divided by ``divide_by`` (N for a mean: gloo has no AVG).
    On gloo this is an all-to-all of the N chunks plus a local sum. ``output`` may be this
    rank's own chunk of ``input`` on gloo at two ranks (:func:`reduces_in_place`): the sum is
    then made in place, the other chunk sent in :data:`IN_PLACE_PIECES` pieces, most of the
    exchange happening when the Handle is waited on (:class:`~fullshard.comm.in_place.InPlaceExchange`).
    Returns a Handle when ``async_op``, else None after completion.
    """
    n = group_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected {n} x {output.numel()} (world size x output)"
        )
    nbytes = output.numel() * output.element_size() * (n - 1)
    entry = _note("reduce_scatter", input.dtype, input.numel(), nbytes, group)
    if backend(group) == "gloo":
        chunks = input.view(n, -1)
        if n == 2 and is_own_chunk(output, chunks[group_rank(group)]):
            me = group_rank(group)
            exchange = InPlaceExchange(chunks[me], chunks[1 - me], group)
            return _finish(
                exchange, (lambda: output.div_(divide_by)) if divide_by != 1.0 else None, async_op, entry, True
            )
        if n == 2 and output.is_contiguous() and not _overlaps(output, input):
            # Send only the other rank's chunk, receive its chunk of ours straight into
            # ``output`` and add our own to it: no receive buffer, no copy of our chunk. (The sum
            # is the same bits as own + received: floating-point addition commutes.)
            me = group_rank(group)
            splits = [0, 0]
            splits[1 - me] = output.numel()
            work = dist.all_to_all_single(
                output, chunks[1 - me], splits, splits, group=group, async_op=_asynchronous(async_op, group)
            )

            def epilogue() -> None:
                output.add_(chunks[me])
                if divide_by != 1.0:
                    output.div_(divide_by)

            return _finish(work, epilogue, async_op, entry, sliced=True)
        received = POOL.acquire(input.numel(), input.dtype, input.device)
        work = dist.all_to_all_single(received, input, group=group, async_op=_asynchronous(async_op, group))

        def epilogue_n() -> None:
            torch.sum(received.view(n, -1), dim=0, out=output)
            POOL.release(received)
            if divide_by != 1.0:
                output.div_(divide_by)

        return _finish(work, epilogue_n, async_op, entry, sliced=True)
    work = _reduce_scatter_fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _finish(work, (lambda: output.div_(divide_by)) if divide_by != 1.0 else None, async_op, entry)


@exposed_comm.blocking("all_to_all", _unit)
@_explained
def all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Handle | None:
    """Exchange equal parts with every other rank: the own part never goes on the wire.

    Args:
        output: shape ((N-1)*K,), receives the part each other rank sent us, in rank order
            (this rank skipped).
        input: shape ((N-1)*K,), holds the part for each other rank, in rank order (this rank
            skipped); same dtype and device as ``output``, both contiguous.
        group: the process group (N ranks).
        async_op: return a Handle instead of waiting.

    Returns:
        A Handle when ``async_op``, else None after completion.

    Raises:
        ValueError: sizes that are not (N-1) equal parts of one size.
    """
    n = group_size(group)
    if output.numel() != input.numel() or (n > 1 and input.numel() % (n - 1)) or (n == 1 and input.numel()):
        raise ValueError(
            f"all_to_all: input has {input.numel()} and output {output.numel()} elements; both must be "
            f"{n - 1} (world size - 1) equal parts"
        )
    entry = _note("all_to_all", input.dtype, input.numel(), input.numel() * input.element_size(), group)
    if n == 1:
        return _finish(None, None, async_op, entry)
    splits = [input.numel() // (n - 1)] * n
    splits[group_rank(group)] = 0
    work = dist.all_to_all_single(output, input, splits, splits, group=group, async_op=_asynchronous(async_op, group))
    return _finish(work, None, async_op, entry, sliced=backend(group) == "gloo")


def reduces_in_place(group: ProcessGroup) -> bool:
    """Whether :func:`reduce_scatter` on ``group`` takes this rank's own chunk of its input as
    its output (gloo at two ranks)."""
    return backend(group) == "gloo" and group_size(group) == 2


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of the contiguous tensors ``a`` and ``b`` overlaps."""
    if a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


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


def predivide_factor(ranks: float) -> int:
    """A power of two near sqrt(ranks) to divide gradients by before a low-precision sum.

    torch FSDP's rule (both front ends): double while it divides ``ranks`` and is below
    ``ranks / factor``, so 2 ranks divide by 2 before the sum and 1 after, 3 by 2 and 1.5.
    """
    factor = 1
    while ranks % factor == 0 and ranks / factor > factor:
        factor *= 2
    return factor


@exposed_comm.blocking("all_reduce", _unit)
@_explained
def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup, divide_by: float = 1.0, async_op: bool = False
) -> Handle | None:
    """Sum ``tensor`` over ranks in place, then divide by ``divide_by``.

    A tensor on a device the group's backend cannot reduce on (a CPU tensor on an NCCL group) is
    reduced through a copy on the group's device and written back.
    """
    n = group_size(group)
    nbytes = 2 * tensor.numel() * tensor.element_size() * (n - 1) // n
    entry = _note("all_reduce", tensor.dtype, tensor.numel(), nbytes, group)
    staged = _staged(tensor, group)
    gloo = backend(group) == "gloo"
    work = dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group, async_op=_asynchronous(async_op, group))
    divide = (lambda: tensor.div_(divide_by)) if divide_by != 1.0 else None
    return _finish(work, _copy_back(staged, tensor, divide), async_op, entry, sliced=gloo)


@exposed_comm.blocking("all_reduce_max", _unit)
@_explained
def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup) -> None:
    """Element-wise maximum of ``tensor`` (any shape and dtype) over the ranks of ``group``, in
    place, synchronous (a tensor on a device the backend cannot reduce on goes through a copy, as
    in :func:`all_reduce`)."""
    entry = _note("all_reduce_max", tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size(), group)
    staged = _staged(tensor, group)
    work = dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=group, async_op=_asynchronous(False, group))
    _finish(work, _copy_back(staged, tensor), False, entry, sliced=backend(group) == "gloo")


@exposed_comm.blocking("broadcast", _unit)
@_explained
def broadcast(tensor: torch.Tensor, src_rank: int, group: ProcessGroup) -> None:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank, in place, synchronous (staged
    like :func:`all_reduce`)."""
    entry = _note("broadcast", tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size(), group)
    staged = _staged(tensor, group)
    src = dist.get_global_rank(group, src_rank)
    work = dist.broadcast(staged, src=src, group=group, async_op=_asynchronous(False, group))
    _finish(work, _copy_back(staged, tensor), False, entry, sliced=backend(group) == "gloo")


@exposed_comm.blocking("all_gather_object", _unit)
@_explained
def all_gather_object(obj: Any, group: ProcessGroup) -> list[Any]:
    """Gather one picklable object per rank of ``group``; returns the list in group rank order
    (length: the group's size). Every rank must call it."""
    out: list[Any] = [None] * group_size(group)
    entry = _note("all_gather_object", torch.uint8, 0, 0, group)
    dist.all_gather_object(out, obj, group=group)
    RECORDER.complete(entry)
    return out


@exposed_comm.blocking("broadcast_object", _unit)
@_explained
def broadcast_object(obj: Any, src_rank: int, group: ProcessGroup) -> Any:
    """Send a picklable object from group rank ``src_rank`` to every rank; returns it on all
    (``obj`` is ignored on the other ranks)."""
    box = [obj if group_rank(group) == src_rank else None]
    entry = _note("broadcast_object", torch.uint8, 0, 0, group)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src_rank), group=group)
    RECORDER.complete(entry)
    return box[0]


@exposed_comm.blocking("barrier", _unit)
@_explained
def barrier(group: ProcessGroup) -> None:
    """Return once every rank of ``group`` has called it (recorded and watched like any collective).

    Raises:
        fullshard.comm.peers.CollectiveError: a rank failed, diverged or timed out (watchdog on).
    """
    entry = _note("barrier", torch.uint8, 0, 0, group)
    work = dist.barrier(group=group, async_op=_asynchronous(False, group))
    _finish(work, None, False, entry, sliced=backend(group) == "gloo")


def clear_caches() -> None:
    """Forget cached group facts (before the groups are destroyed)."""
    _FACTS.clear()
