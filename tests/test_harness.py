"""The multi-rank harness (tests/dist.py): what one call leaves in a kept rank process (patched
collectives, fullshard's process-wide state) is gone by the next call in the same process."""

from __future__ import annotations

import os

import pytest
import torch
from dist import patched, run_ranks


def _leave_a_mess(rank: int, world: int) -> int:
    """Patch collectives without restoring them and leave fullshard's process-wide state behind."""
    import torch.distributed as dist

    from fullshard import enable_watchdog, probes, set_collective_timeout
    from fullshard.comm import buffers, collectives, flight_recorder

    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("a patch from an earlier call leaked into this one")

    dist.all_reduce = broken
    collectives._all_gather_fn = broken
    collectives.backend = broken
    buffers.POOL.release(torch.empty(1000))
    flight_recorder.RECORDER.context.unit = "leaked-unit"
    flight_recorder.RECORDER.entries.append(object())  # type: ignore[arg-type]
    enable_watchdog()
    set_collective_timeout(5.0)
    probes.ACTIVE = probes.Probes(events=None)
    return os.getpid()


def _check_clean(rank: int, world: int) -> tuple[int, list[str]]:
    import torch.distributed as dist

    from fullshard import probes
    from fullshard.comm import buffers, collectives, flight_recorder, watchdog

    left = []
    if dist.all_reduce.__name__ == "broken":
        left.append("dist.all_reduce")
    if collectives._all_gather_fn.__name__ == "broken":
        left.append("collectives._all_gather_fn")
    if collectives.backend.__name__ == "broken":
        left.append("collectives.backend")
    if buffers.POOL.nbytes:
        left.append(f"POOL holds {buffers.POOL.nbytes} bytes")
    if flight_recorder.RECORDER.context.unit is not None or flight_recorder.RECORDER.entries:
        left.append("flight recorder")
    if watchdog._WANTED is not None or watchdog._TIMEOUT is not None:
        left.append("watchdog settings")
    if probes.ACTIVE is not None:
        left.append("probes")
    t = torch.ones(2)
    collectives.all_reduce(t, collectives.default_group())  # the real collectives work again
    if t.tolist() != [float(world)] * 2:
        left.append(f"all_reduce gave {t.tolist()}")
    return os.getpid(), left


def test_a_call_leaves_nothing_for_the_next_in_the_same_ranks() -> None:
    pids = run_ranks(_leave_a_mess, 2)
    after = run_ranks(_check_clean, 2)
    assert [pid for pid, _ in after] == pids, "the second call ran in other processes: nothing was tested"
    assert [left for _, left in after] == [[], []]


def test_patched_restores_also_when_the_block_raises() -> None:
    holder = type("Holder", (), {"value": 1})
    with pytest.raises(KeyError), patched(holder, value=2, added=3):
        assert holder.value == 2 and holder.added == 3  # type: ignore[attr-defined]
        raise KeyError
    assert holder.value == 1 and not hasattr(holder, "added")


def _crash_one(rank: int, world: int) -> int:
    """Rank 1 dies of a signal (as a native crash in gloo's thread would end it); rank 0 then
    fails in its all-reduce with only "connection closed by peer"."""
    import signal

    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(4))
    return rank


@pytest.mark.timeout(120)
def test_a_peer_that_crashed_is_named_with_its_signal() -> None:
    """The survivor's traceback alone does not say which rank died or how: the error names it."""
    with pytest.raises(RuntimeError, match=r"rank 1 ended \(SIGSEGV\)"):
        run_ranks(_crash_one, 2, timeout=100)
