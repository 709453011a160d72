"""The two-rank reduce-scatter that sums into this rank's own chunk of its input (gloo):
:class:`InPlaceExchange`, issued by :func:`fullshard.comm.collectives.reduce_scatter`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fullshard.comm.buffers import POOL

ProcessGroup = Any  # as in fullshard.comm.collectives: torch moves the type between versions

IN_PLACE_PIECES = 8  # pieces of an in-place reduce-scatter; its staging buffer is 1/8 of a chunk


def is_own_chunk(output: torch.Tensor, chunk: torch.Tensor) -> bool:
    return output.data_ptr() == chunk.data_ptr() and output.numel() == chunk.numel() and output.is_contiguous()


class InPlaceExchange:
    """A two-rank reduce-scatter that leaves the sum in this rank's own chunk of the input.

    The other rank's chunk goes out in :data:`IN_PLACE_PIECES` pieces, one all-to-all each, one
    after another: piece j is received into the place of piece j - 1, sent by the all-to-all
    before (piece 0 into a staging buffer from :data:`POOL`), and added to the own chunk as it
    arrives (own + received: the bits of every other path). Piece 0 is issued at once, the rest
    by :meth:`wait` (a Handle's work: ``wait(timeout)`` may stop between or inside pieces and be
    called again). The caller's rank order is the same on both ranks, so the pieces pair up.
    """

    def __init__(self, own: torch.Tensor, other: torch.Tensor, group: ProcessGroup) -> None:
        self.group = group
        self.peer = 1 - dist.get_rank(group)
        pieces = max(1, min(IN_PLACE_PIECES, other.numel()))
        self.owns = own.tensor_split(pieces)
        self.sends = other.tensor_split(pieces)  # the same sizes on both ranks, largest first
        self.stage = POOL.acquire(self.sends[0].numel(), other.dtype, other.device)
        self.piece = 0
        self.work: Any = self._issue(0)

    def _received(self, j: int) -> torch.Tensor:
        """Where piece ``j`` arrives: the stage, or the place of the piece sent before it."""
        return (self.stage if j == 0 else self.sends[j - 1])[: self.sends[j].numel()]

    def _issue(self, j: int) -> Any:
        splits = [0, 0]
        splits[self.peer] = self.sends[j].numel()
        return dist.all_to_all_single(self._received(j), self.sends[j], splits, splits, group=self.group, async_op=True)

    def wait(self, timeout: Any = None) -> None:
        """Finish every piece (raises RuntimeError when ``timeout`` ends inside one; call again)."""
        while self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout)
            j = self.piece
            self.owns[j].add_(self._received(j))
            self.piece, self.work = j + 1, None
            if self.piece < len(self.sends):
                self.work = self._issue(self.piece)
            else:
                POOL.release(self.stage)

    def is_completed(self) -> bool:
        return self.work is None
