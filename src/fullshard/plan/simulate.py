"""Predicted step time: fullshard's schedule replayed on calibrated costs.

Two clocks advance: compute (one stream of forward and backward work) and communication (one
process group's collectives, one at a time, in issue order). The schedule is the engine's
(:mod:`fullshard.engine.hooks`):

- forward: the root gathers first; each unit gathers at its pre-forward (with
  ``forward_prefetch``, the next unit's gather is issued then too) and computes once its
  parameters are there;
- backward, units in reverse: a unit that resharded after forward gathers again (with
  BACKWARD_PRE the next unit's gather is issued at this one's pre-backward, with BACKWARD_POST
  after its backward), computes its backward (under activation checkpointing the recomputed
  forward first: a checkpointed unit's calibrated backward includes it), then waits for the
  previous unit's reduce-scatter (one in flight) and issues its own;
- the step ends when the last reduction is done, then the optimizer steps on the shards.

Each unit's own engine time (``UnitCost.overhead``, :mod:`fullshard.plan.overhead`: hooks,
copies, a collective's issue and wait beyond its fitted cost) runs on the compute clock, half
in forward and half in backward, and is reported as ``StepTime.engine``.

NO_SHARD gathers nothing and all-reduces gradients instead of reduce-scattering them. Under CPU
offload a unit's shard is uploaded before each of its gathers and its gradient shard downloaded
after its reduce-scatter, in the same stream (``CommModel.h2d`` / ``d2h``), and the optimizer
steps on the CPU.

Where the ranks' compute threads leave no core per rank free (``CommModel.contended``: gloo on
a CPU with cores - ranks x intra-op threads < ranks), a collective has no core of its own: measured on this
project's 2-core machine, a step's collectives then cost about their wall time plus the CPU time
they spend (gloo's copies and socket work), hidden or not. The replay then charges each
collective ``seconds x (1 + cpu_share)`` on the compute clock and overlaps nothing.
"""

from __future__ import annotations

import dataclasses

from fullshard.plan.calibrate import FREE, BlockTime, CommModel


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """One unit in forward order: its compute, the bytes it moves and its settings."""

    name: str
    time: BlockTime
    gather_bytes: int  # full parameters in the compute dtype (0: nothing to gather)
    reduce_bytes: int  # full flat gradient in the reduce dtype
    reshard_after_forward: bool = True
    checkpoint: bool = False  # recomputed in backward: ``time`` as checkpointing runs it, recomputation included
    h2d_bytes: int = 0  # CPU offload: the shard uploaded before each gather
    d2h_bytes: int = 0  # CPU offload: the gradient shard downloaded after the reduce-scatter
    overhead: float = 0.0  # the engine's own seconds per step (fullshard.plan.overhead), half in each pass


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step and how they split."""

    seconds: float
    compute: float
    exposed_comm: float
    optimizer: float
    communication: float = 0.0  # every collective's own seconds, summed (hidden or not)
    engine: float = 0.0  # the engine's own work (hooks, copies, waits; fullshard.plan.overhead), not in compute


class _Clock:
    """The communication stream: a collective starts when issued and the previous one is done."""

    def __init__(self, comm: CommModel, no_shard: bool) -> None:
        self.free = 0.0
        self.busy = 0.0
        self.comm = comm
        self.ag = comm.all_gather if not no_shard else FREE
        self.reduce = comm.all_reduce if no_shard else comm.reduce_scatter

    def _issue(self, seconds: float, at: float) -> float:
        start = max(self.free, at)
        self.free = start + seconds
        self.busy += seconds
        return self.free

    def gather(self, u: UnitCost, at: float) -> float:
        """Issue ``u``'s gather (its offload upload first) at ``at``; returns when it is done."""
        return self._issue(self.ag.seconds(u.gather_bytes) + self.comm.h2d.seconds(u.h2d_bytes), at)

    def reduction(self, u: UnitCost, at: float) -> float:
        """Issue ``u``'s gradient reduction (its offload download after) at ``at``; returns when done."""
        return self._issue(self.reduce.seconds(u.reduce_bytes) + self.comm.d2h.seconds(u.d2h_bytes), at)


def merge_costs(units: list[UnitCost], size: int) -> list[UnitCost]:
    """``units`` (forward order) grouped ``size`` consecutive ones to a unit (the last group may
    be smaller), as ``fully_shard`` of a list of modules makes them: one gather and one
    reduction of the summed bytes, compute summed (a checkpointed member's backward, its
    recomputation included, goes into the group's backward), resharding as the group's first member.

    Raises:
        ValueError: ``size`` is below 1.
    """
    if size < 1:
        raise ValueError(f"size={size}: group at least one unit")
    out = []
    for i in range(0, len(units), size):
        chunk = units[i : i + size]
        if len(chunk) == 1:
            out.append(chunk[0])
            continue
        forward = sum(u.time.forward for u in chunk)
        backward = sum(u.time.backward for u in chunk)
        out.append(
            UnitCost(
                chunk[0].name,
                BlockTime(forward, backward),
                sum(u.gather_bytes for u in chunk),
                sum(u.reduce_bytes for u in chunk),
                chunk[0].reshard_after_forward,
                h2d_bytes=sum(u.h2d_bytes for u in chunk),
                d2h_bytes=sum(u.d2h_bytes for u in chunk),
                overhead=chunk[0].overhead,  # one unit's: the engine's work is per unit
            )
        )
    return out


def simulate_step(
    root: UnitCost,
    units: list[UnitCost],
    comm: CommModel,
    *,
    root_split: float = 0.5,
    no_shard: bool = False,
    forward_prefetch: bool = False,
    backward_prefetch: str | None = "pre",
    optimizer_seconds: float = 0.0,
) -> StepTime:
    """Replay one training step (see module docstring).

    Args:
        root: the root unit; its forward (loss included) runs ``root_split`` before the units
            and the rest after them, its backward the other way round.
        units: the other units in forward order.
        comm: fitted collective costs for this backend and world size.
        no_shard: replicated parameters (no gathers; gradients all-reduced).
        backward_prefetch: ``"pre"``, ``"post"`` or None.
        optimizer_seconds: the optimizer step on this rank's shard.

    Raises:
        ValueError: ``backward_prefetch`` is not pre, post or None.
    """
    if backward_prefetch not in ("pre", "post", None):
        raise ValueError(f"backward_prefetch={backward_prefetch!r}: use 'pre', 'post' or None")
    net = _Clock(comm, no_shard)
    gather, reduction = net.gather, net.reduction
    now = gather(root, 0.0) + root.time.forward * root_split + root.overhead / 2
    ahead: dict[int, float] = {}
    for i, u in enumerate(units):
        ready = ahead.pop(i) if i in ahead else gather(u, now)
        now = max(now, ready)
        if forward_prefetch and i + 1 < len(units):
            ahead[i + 1] = gather(units[i + 1], now)
        now += u.time.forward + u.overhead / 2
    now += root.time.forward * (1 - root_split) + root.time.backward * (1 - root_split)
    ahead, in_flight = {}, 0.0
    for i in reversed(range(len(units))):
        u = units[i]
        if u.reshard_after_forward:
            ready = ahead.pop(i) if i in ahead else gather(u, now)
            now = max(now, ready)
        prev = units[i - 1] if i else None
        if backward_prefetch == "pre" and prev is not None and prev.reshard_after_forward:
            ahead[i - 1] = gather(prev, now)
        now += u.time.backward + u.overhead / 2
        if backward_prefetch == "post" and prev is not None and prev.reshard_after_forward:
            ahead[i - 1] = gather(prev, now)
        now = max(now, in_flight)
        in_flight = reduction(u, now)
    now += root.time.backward * root_split + root.overhead / 2
    now = max(now, in_flight)
    now = max(now, reduction(root, now))
    compute = sum(u.time.forward + u.time.backward for u in [root, *units])
    engine = sum(u.overhead for u in [root, *units])
    if comm.contended:  # nothing overlaps: every collective's wall time plus its CPU time
        now = compute + engine + net.busy * (1 + comm.cpu_share)
    exposed = now - compute - engine
    return StepTime(now + optimizer_seconds, compute, exposed, optimizer_seconds, net.busy, engine)
