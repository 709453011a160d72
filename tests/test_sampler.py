"""ResumableSampler: an epoch resumed at a global sample position, at any world size, trains
exactly the samples not yet trained, and at the same world size continues each rank's sequence."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DistributedSampler

from fullshard.jobs.data.sampler import ResumableSampler

DATA = range(100)  # only the length counts
SEED, EPOCH, BATCH = 7, 3, 4


def _sampler(world: int, rank: int, start: int = 0) -> ResumableSampler:
    s = ResumableSampler(DATA, num_replicas=world, rank=rank, seed=SEED)
    s.set_epoch(EPOCH)
    s.set_start(start)
    return s


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_from_the_start_it_is_torchs_distributed_sampler(world: int) -> None:
    for rank in range(world):
        torch_s = DistributedSampler(DATA, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
        torch_s.set_epoch(EPOCH)
        assert list(_sampler(world, rank)) == list(torch_s)
        assert len(_sampler(world, rank)) == len(torch_s)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_same_world_resume_continues_every_rank_where_it_stopped(world: int) -> None:
    """What a same-world-size resume after ``b`` batches of every rank gives: each rank's own
    sequence from its batch ``b`` on (so resumes stay bitwise as before)."""
    for rank, b in itertools.product(range(world), range(len(_sampler(world, 0)) // BATCH)):
        whole = list(_sampler(world, rank))
        assert list(_sampler(world, rank, world * BATCH * b)) == whole[BATCH * b :]


def _trained(world: int, batches: int) -> list[int]:
    """The samples all ranks trained in ``batches`` batches of BATCH each."""
    return [i for rank in range(world) for i in list(_sampler(world, rank))[: BATCH * batches]]


@pytest.mark.parametrize(("old", "new"), [(2, 1), (2, 3), (3, 2), (1, 4), (2, 2)])
def test_resume_at_another_world_size_trains_each_remaining_sample_once(old: int, new: int) -> None:
    """Before the resume ``old`` ranks trained ``b`` batches each; after it ``new`` ranks train
    the rest: every sample of the epoch once, plus at most ``new - 1`` repeats (the padding that
    gives every rank the same number of samples, as DistributedSampler pads)."""
    for b in range(len(_sampler(old, 0)) // BATCH):
        before = _trained(old, b)
        after = [list(_sampler(new, rank, len(before))) for rank in range(new)]
        assert len({len(a) for a in after}) == 1  # every rank the same count: the same steps
        seen = before + [i for a in after for i in a]
        assert set(seen) == set(DATA)
        assert len(seen) - len(DATA) < new  # only the padding repeats
        assert len(set(before)) == len(before)  # mid-epoch: no padding yet


def test_a_position_at_the_end_leaves_nothing_and_a_negative_one_is_refused() -> None:
    assert list(_sampler(3, 2, 100)) == [] and len(_sampler(3, 2, 102)) == 0
    with pytest.raises(ValueError, match="position must be at least 0, got -1"):
        _sampler(2, 0).set_start(-1)
