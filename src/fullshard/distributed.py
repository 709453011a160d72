"""Communication for a training loop's own numbers (losses, token counts, timings, plans).

These are the collectives fullshard issues for its units, so a loop's own calls are recorded by
the flight recorder, counted in the exposed communication time, and watched by the watchdog
like the gradient reductions: a rank stuck in an ``all_reduce`` of a loss is named as such.
Every function takes the process group explicitly; :func:`default_group` is the world.

The functions live in :mod:`fullshard.comm.collectives` and :mod:`fullshard.comm.exposed_comm`;
this module only re-exports them.
"""

from fullshard.comm.collectives import (
    all_gather_object,
    all_reduce,
    all_reduce_max,
    barrier,
    broadcast_object,
    default_group,
    group_rank,
    group_size,
)
from fullshard.comm.exposed_comm import exposed_seconds

__all__ = [
    "all_gather_object",
    "all_reduce",
    "all_reduce_max",
    "barrier",
    "broadcast_object",
    "default_group",
    "exposed_seconds",
    "group_rank",
    "group_size",
]
