"""Buffers that FSDP needs again and again, kept instead of freed.

A fresh CPU buffer costs more than the copy into it: torch's CPU allocator hands large blocks
back to the operating system when they are freed, and the next allocation of that size faults
its pages in again, each one zeroed by the kernel (on this project's machine about 0.75 ms per
MiB, against about 0.1 ms per MiB for a copy). FSDP needs a buffer of each unit's size several
times per step: the full parameters, the packed gradients, the reduce-scatter's receive buffer,
the gradient shards. So fullshard keeps them:

- :data:`POOL` holds buffers given back after use, at most ``per_size`` of each (numel, dtype,
  device): CPU buffers across steps until the process group is destroyed, GPU buffers within
  one backward (across steps CUDA's caching allocator reuses memory itself). A unit's full flat
  buffer and its packed gradient have the same size, so the memory one gives back serves the
  other.
- :meth:`BufferPool.acquire` hands out a buffer (a kept one when there is one), and
  :meth:`BufferPool.release` returns it to be kept. A buffer lent to a collective in flight
  (:meth:`BufferPool.lend`: a packed gradient being reduce-scattered) counts against
  ``per_size`` until it comes back, so the pool does not keep a buffer idle beside it that it
  would have to drop when the lent one returns: a surplus buffer is freed when it is given back,
  not a unit later (issue 33: at the end of backward that frees one unit's buffer before the
  root's embedding gradients are allocated, 48 MiB off the 167M GPT's peak).
- :func:`acquire_storage` and :func:`release_storage` move a pooled buffer's memory into a
  storage that must keep its identity (a unit's full flat buffer, whose storage autograd's saved
  views hold), by swapping data pointers, and back into the pool.
- :func:`sole_owner` says whether a buffer handed out as views (gradient shards) is free again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Iterator

import torch

from fullshard import compat


class BufferPool:
    """Whole 1-D buffers kept between uses, so the next buffer of the same size skips the allocator.

    ``take`` returns a 1-D tensor of ``numel`` elements with arbitrary contents; ``give`` returns
    it for reuse. At most ``per_size`` buffers are kept for each (numel, dtype, device); ``clear``
    drops them all.
    """

    def __init__(self, per_size: int = 2) -> None:
        self.per_size = per_size
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lent: dict[tuple[int, torch.dtype, torch.device], int] = {}

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``numel`` elements of ``dtype`` on ``device``: a kept one, or a new empty one.

        Never an inference tensor: one made under ``torch.inference_mode()`` could not be written
        in place after it, and the buffer is kept for later steps."""
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return torch.empty(numel, dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device=device)

    def release(self, t: torch.Tensor, lent: bool = False) -> None:
        """Return ``t`` to be kept (up to ``per_size`` of its key, counting those lent out);
        views and partial buffers are dropped. ``lent``: ``t`` was passed to :meth:`lend`."""
        key = (t.numel(), t.dtype, t.device)
        if lent and self._lent.get(key, 0) > 0:
            self._lent[key] -= 1
        if not whole(t) or t.is_inference():
            return  # only whole buffers come back, and none made under inference mode
        free = self._free.setdefault(key, [])
        if len(free) + self._lent.get(key, 0) < self.per_size:
            free.append(t)

    def lend(self, t: torch.Tensor) -> None:
        """Note that ``t`` is in use by a collective in flight and comes back with
        ``release(t, lent=True)`` when it is waited on: until then it counts against its key's
        ``per_size``. A view or partial buffer (which would not be kept) is not counted."""
        if whole(t):
            key = (t.numel(), t.dtype, t.device)
            self._lent[key] = self._lent.get(key, 0) + 1

    def forget_lent(self, t: torch.Tensor) -> None:
        """Stop counting ``t``, passed to :meth:`lend`, which stays in use elsewhere (gradient
        shards live in it) and is not given back."""
        key = (t.numel(), t.dtype, t.device)
        if whole(t) and self._lent.get(key, 0) > 0:
            self._lent[key] -= 1

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def held_sizes(self) -> set[tuple[int, torch.dtype]]:
        """The (numel, dtype) of the buffers held for reuse, on any device (empty: none held)."""
        return {(key[0], key[1]) for key, ts in self._free.items() if ts}

    def buffers(self) -> list[torch.Tensor]:
        """The buffers held for reuse (for tests and measurements)."""
        return [t for ts in self._free.values() for t in ts]

    @contextlib.contextmanager
    def transient(self) -> Iterator[None]:
        """A ``with`` block whose buffers do not outlive it: buffers given to the pool inside it
        are dropped when it ends (on error too); those held before it, taken and given back
        inside it, stay. For one-off work beside training (the planner's start-up timing of
        collectives), whose buffer sizes training may never ask for again."""
        before = {id(t): weakref.ref(t) for t in self.buffers()}  # weak: a buffer taken may be freed

        def held_before(t: torch.Tensor) -> bool:
            ref = before.get(id(t))
            return ref is not None and ref() is t

        try:
            yield
        finally:
            self._free = {key: kept for key, ts in self._free.items() if (kept := [t for t in ts if held_before(t)])}

    def drop(self, sizes: Collection[tuple[int, torch.dtype]]) -> None:
        """Free the buffers held of each (numel, dtype) in ``sizes``, on every device."""
        if sizes:
            self._free = {key: ts for key, ts in self._free.items() if (key[0], key[1]) not in sizes}

    def clear(self, keep_cpu: bool = False) -> None:
        """Drop the buffers held (with ``keep_cpu``, only those not in CPU memory); without
        ``keep_cpu`` also forget the buffers lent out (a fresh start)."""
        if keep_cpu:
            self._free = {key: ts for key, ts in self._free.items() if key[2].type == "cpu"}
        else:
            self._free.clear()
            self._lent.clear()


def whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is a whole buffer: no view, contiguous, its storage exactly its elements."""
    return not compat.is_view(t) and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


POOL = BufferPool()


def acquire_storage(
    storage: torch.UntypedStorage, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Give the empty ``storage`` the memory of ``numel`` elements of ``dtype`` on ``device``.

    On CPU the memory comes from :data:`POOL` by swapping data pointers: ``storage`` keeps its
    identity, so every view of it sees the new memory. Returns the pooled tensor, which now owns
    ``storage``'s former empty allocation and must be passed to :func:`release_storage`; elsewhere
    (CUDA's caching allocator already reuses memory; a torch without the swap,
    :data:`fullshard.compat.STORAGE_SWAP`) ``storage`` is resized and None is returned.
    """
    if compat.STORAGE_SWAP and device.type == "cpu":
        pooled = POOL.acquire(numel, dtype, device)
        compat.swap_storage_memory(storage, pooled.untyped_storage())
        return pooled
    storage.resize_(numel * dtype.itemsize)
    return None


def release_storage(storage: torch.UntypedStorage, pooled: torch.Tensor | None) -> None:
    """Empty ``storage`` again: its memory back to :data:`POOL` (``pooled`` from
    :func:`acquire_storage`), or freed."""
    if pooled is not None:
        compat.swap_storage_memory(storage, pooled.untyped_storage())
        POOL.release(pooled)
    else:
        storage.resize_(0)


# The count of a storage that one tensor alone uses, measured rather than assumed (the Python
# storage object torch keeps may hold a reference of its own).
_ALONE_USES = compat.storage_use_count(torch.empty(1))


def sole_owner(t: torch.Tensor) -> bool:
    """Whether no tensor but ``t`` uses ``t``'s storage (every view handed out is gone)."""
    return compat.storage_use_count(t) == _ALONE_USES
