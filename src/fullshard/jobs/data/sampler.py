"""A distributed sampler that can start an epoch part-way, at any world size.

Vocabulary. An epoch's *order* is the permutation of the dataset fixed by the seed and the
epoch alone (``torch.utils.data.DistributedSampler``'s, which does not depend on the world size).
The *position* is how many samples of that order all ranks together have trained; it is the
only thing a checkpoint needs to say where the epoch stands, whatever the world size that
saved it and the one that resumes it. From position ``s`` the rest of the order, padded at the
end (from the order's beginning, as torch pads) to a multiple of the world size, is dealt out
round-robin: rank ``r`` takes entries ``s + r``, ``s + r + W``, ... At position 0 this is
``DistributedSampler`` exactly, and at a position reached by the same world size it continues
each rank's sequence exactly where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler(shuffle=True, drop_last=False)`` whose epoch starts at a position
    (:meth:`set_start`), a number of samples of the epoch's order already trained by all ranks.

    Args:
        dataset: the dataset (only its length is used).
        num_replicas: the world size.
        rank: this rank, in ``[0, num_replicas)``.
        seed: the shuffle's seed; the epoch ``e``'s order is ``randperm`` seeded ``seed + e``.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)  # type: ignore[arg-type]
        self.start = 0

    def set_start(self, position: int) -> None:
        """Start the epoch after ``position`` samples of its order (all ranks together); 0 is the
        epoch's beginning, a position at or past the dataset's length leaves nothing to train.

        Raises:
            ValueError: ``position`` is negative.
        """
        if position < 0:
            raise ValueError(f"ResumableSampler.set_start: position must be at least 0, got {position}")
        self.start = position

    def __len__(self) -> int:
        rest = max(len(self.dataset) - self.start, 0)  # type: ignore[arg-type]
        return math.ceil(rest / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order: list[int] = torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]
        end = self.start + len(self) * self.num_replicas  # the padded order's length
        padding = end - len(order)
        if padding > 0:
            order += (order * math.ceil(padding / len(order)))[:padding]
        return iter(order[self.start + self.rank : end : self.num_replicas])
