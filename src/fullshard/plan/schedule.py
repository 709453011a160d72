"""The FSDP step's buffers moment by moment, on gloo (CPU), replayed over a meta-device trace.

:func:`~fullshard.plan.peak.trace_step` records, at every allocation of the unwrapped model's
traced step, the bytes alive, the gradient bytes each unit's parameters have produced, the phase
and the unit running. :func:`replay` walks those samples and does, at each change of unit, what
the engine's hooks do (:mod:`fullshard.engine.hooks`, :mod:`~fullshard.engine.reduce`,
:mod:`fullshard.comm.buffers`) with rank 0's buffers, then takes the step's peak as the largest
of, over every sample and every moment between two samples:

    model state (shards, optimizer state, gradient shards as they stand then)
    + the unit-sized buffers in use then (full parameters, all-gather scratch, packed gradients,
      reduce-scatter receive buffers) + those the buffer pool holds
    + the per-parameter gradients of every unit not yet packed (the root's until backward ends)
    + the traced activations at that moment.

What each hook does, as the engine does it (``backward_prefetch=BACKWARD_PRE``; the planner's
settings too: some units kept gathered after forward, units of several blocks, forward
prefetch):

- pre-forward of a unit: its full parameters are gathered into pooled memory (``buffers.acquire_storage``);
  at world > 1, each run of small parameters is all-gathered through a pooled scratch buffer of
  ``world x run`` elements given back when the gather is waited on; the root gathers first and
  keeps its parameters until its own gradients are packed;
- with forward prefetch, pre-forward then starts the next unit's gather (its scratch held
  until that unit's pre-forward waits on it);
- post-forward: FULL_SHARD gives the full parameters back to the pool; SHARD_GRAD_OP and
  NO_SHARD keep them, and so do the units ``kept`` names (the planner's last units kept
  gathered) and, for the wrapper (``keep_last``), the last unit of forward;
- pre-backward (a unit's backward starts): it gathers again if it had resharded, and starts the
  gather of the nearest unit before it in forward order that runs backward (its scratch held
  until that unit waits on it; a unit whose output needs no gradient is never prefetched); the
  root's, first in backward, starts the last unit of forward's (a no-op where it is kept);
- the last gradient of a unit: its full parameters go back to the pool and the packed gradient
  (``world x S_t`` elements, compute dtype) is taken from it while the per-parameter gradients
  still exist (a unit that activation checkpointing recomputes keeps its full parameters until
  its reduce-scatter has started: the recomputation's views of them are still open then, so
  ``Unit.reshard_for_packing`` waits for the post-backward hook). Then the previous unit's
  reduction is finished: its packed gradient and receive buffer go back to the pool, and
  gradient shards of another dtype than the reduction's get a fresh buffer. Then this unit's
  reduce-scatter starts: its receive buffer (the whole input, above 2 ranks; at 2 ranks the
  other rank's chunk arrives straight in the output) is taken from the pool, its output is the
  unit's gradient-shard buffer, kept between steps. At 2 ranks a unit whose full buffer's size
  no other pooled buffer has (typically the root) reduces in place instead: its gradient shards
  stay in its own chunk of the packed gradient (no gradient-shard buffer; a staging buffer of
  one eighth of a shard while in flight), which goes back to the pool at its next gather. At
  one rank (and under NO_SHARD) the packed gradient is the gradient: it is never given back;
  cast to the parameter dtype, it is freed once the cast copy is made;
- a unit with no trainable parameter has no gradient hook; an identity on its forward inputs
  stands in for its post-backward: when backward leaves it for the last time (the next unit's
  backward starts), it reshards, before that unit gathers, and finishes no reduction; one that
  never runs backward (its output needs no gradient) is not gathered in backward; a unit with some frozen
  parameters keeps its full parameters until its post-backward (``reshard_for_packing`` skips
  it: the frozen ones' users may still run);
- after a unit's post-backward, when no unit still to run backward will gather (only the
  root is left, gathered since forward; a prefetch not yet waited on still counts as a gather
  to come, its unit SHARDED in the engine until then), the pool frees the buffers of sizes
  only the units already done use (units backward never reaches count as done): they would
  sit idle through the root's backward, where a model with large embeddings peaks;
- end of backward: every reduction finished, every unit resharded.

The pool keeps at most two buffers of each (numel, dtype), counting a packed gradient lent to
the reduction in flight, and keeps them across steps, so the replay runs the step twice and
measures the second, as the engine's steady state.

A unit of several blocks (``fully_shard`` of a list; :func:`grouped` merges the trace's
blocks into it) gathers once for all of them and packs one gradient when its last block's
gradients are in; it counts as recomputed when any of its blocks is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from fullshard.comm.in_place import IN_PLACE_PIECES
from fullshard.plan.estimate import UnitEstimate
from fullshard.plan.unit_buffers import ROOT, UnitBuffers, grouped_params, unit_buffers

__all__ = ["POOL_PER_SIZE", "Peak", "UnitBuffers", "grouped_params", "model_state", "replay", "unit_buffers"]

POOL_PER_SIZE = 2  # fullshard.comm.buffers.POOL keeps at most this many buffers per (numel, dtype)

Key = tuple[int, int]  # (numel, itemsize): a pooled buffer's size class


@dataclasses.dataclass
class _Pool:
    """Unit-sized buffers: in use (bytes) and kept by the pool (count per size class)."""

    in_use: int = 0
    kept: dict[Key, int] = dataclasses.field(default_factory=dict)
    lent: dict[Key, int] = dataclasses.field(default_factory=dict)  # in use by a reduction in flight

    @property
    def bytes(self) -> int:
        return self.in_use + sum(n * k[0] * k[1] for k, n in self.kept.items())

    def acquire(self, key: Key) -> None:
        if key[0] == 0:
            return
        if self.kept.get(key, 0):
            self.kept[key] -= 1
        self.in_use += key[0] * key[1]

    def release(self, key: Key, lent: bool = False) -> None:
        if key[0] == 0:
            return
        self.in_use -= key[0] * key[1]
        if lent:
            self.lent[key] -= 1
        if self.kept.get(key, 0) + self.lent.get(key, 0) < POOL_PER_SIZE:
            self.kept[key] = self.kept.get(key, 0) + 1

    def lend(self, key: Key) -> None:
        """A buffer in use goes to a reduction in flight: it counts against the pool's cap."""
        if key[0]:
            self.lent[key] = self.lent.get(key, 0) + 1

    def drop(self, key: Key) -> None:
        """A buffer taken from the pool and freed, never given back."""
        self.in_use -= key[0] * key[1]


@dataclasses.dataclass(frozen=True)
class Peak:
    """The replay's peak: total bytes, its parts (see :func:`replay`), its phase and unit."""

    total: int
    grads: int  # gradient shards, gradients and per-parameter gradients not yet packed
    gathered: int  # full parameters, all-gather scratch and what the pool keeps
    grad_buffer: int  # packed gradients and receive buffers in flight
    activations: int
    phase: str
    unit: str


class _Replay:
    """One rank's FSDP buffers through a traced step (see the module docstring)."""

    def __init__(
        self,
        units: list[UnitBuffers],
        world: int,
        kept: Collection[str],
        state: int,
        act: Sequence[int],
        recomputed: Collection[str],
        offload: bool = False,
    ) -> None:
        self.recomputed = set(recomputed)
        self.units = {u.name: u for u in units}
        self.index = {u.name: i for i, u in enumerate(units)}
        self.world = world
        self.kept = set(kept)  # units that keep their full parameters after forward
        self.offload = offload  # gradient shards live on the host
        self.state = state  # shards and optimizer state, constant
        self.act = act
        self.pool = _Pool()
        self.best: Peak | None = None
        self.measuring = False
        self.now: tuple[int, int, tuple[str, str]] = (0, 0, ("forward", ROOT))
        self.packing: list[Key] = []  # the packed gradient being filled
        self.forward_prefetch = False
        self.unit_of: dict[str, str] = {}  # block -> its unit (units of several blocks)
        self.closing: set[str] = set()  # each several-block unit's last block
        self.in_place = _in_place_units(units) if world == 2 and not offload else set()
        self.pinned: dict[str, Key] = {}  # in-place units' packed gradients holding their shards' (across steps)

    # -------------------------------------------------------------- per step
    def start(self, order: list[str]) -> None:
        self.order = order
        self.gathered: set[str] = set()
        self.pending: set[str] = set()  # gathers started and not yet waited on (prefetches)
        self.runs_backward: set[str] = set(order)  # the units backward reaches (set by _step)
        self.scratch_held: dict[str, list[Key]] = {}
        self.packed: set[str] = set()
        self.grads = 0  # gradient bytes outside the pool: shards' buffers, cast copies
        if self.world > 1 and not self.offload:  # each unit's reduce-scatter output, kept between steps
            self.grads = sum(u.shard_grad * u.reduce for u in self.units.values() if u.name not in self.in_place)
        self.in_flight: list[tuple[str, list[Key]]] = []  # the reduction launched last
        self.flight_bytes = 0

    def key(self, numel: int, itemsize: int) -> Key:
        return (numel, itemsize)

    def gather(self, name: str, wait: bool) -> None:
        """Gather ``name`` (started; with ``wait`` also waited on, its scratch given back),
        observed with its scratch."""
        u = self.units[name]
        if name in self.gathered or not u.full:
            self.gathered.add(name)
            if wait:
                self.wait(name)
            return
        self.gathered.add(name)
        self.pending.add(name)
        self.reclaim(name)
        self.pool.acquire(self.key(u.full, u.compute))
        keys = [self.key(s, u.compute) for s in u.scratch]
        for k in keys:
            self.pool.acquire(k)
        self.scratch_held[name] = keys
        self.observe()
        if wait:
            self.wait(name)

    def gather_first_of_backward(self, samples: Sequence[tuple[int, tuple[int, ...], bool, str]]) -> None:
        """The root's pre-backward: start the gather of the last unit of forward that runs
        backward (:func:`fullshard.engine.hook_state.backward_neighbour` with ``first``); a unit kept
        gathered since forward gathers nothing."""
        ran = {self.unit_of.get(block, block) for _, _, back, block in samples if not back}
        last = next((u for u in reversed(self.order[1:]) if u in ran and u in self.runs_backward), None)
        if last is not None and last not in self.packed:
            self.gather(last, wait=False)

    def wait(self, name: str) -> None:
        self.pending.discard(name)
        for k in self.scratch_held.pop(name, []):
            self.pool.release(k)

    def post_forward(self, block: str) -> None:
        """Forward left ``block``: its unit reshards if this was the unit's last block and it
        is not kept gathered."""
        name = self.unit_of.get(block, block)
        if (block not in self.unit_of or block in self.closing) and name not in self.kept:
            self.reshard(name)

    def reshard(self, name: str) -> None:
        if name in self.gathered:
            self.wait(name)
            self.gathered.discard(name)
            u = self.units[name]
            self.pool.release(self.key(u.full, u.compute))

    def pack(self, name: str, grads: tuple[int, ...]) -> None:
        """``name``'s last gradient came (``grads``: produced per unit): reshard, pack (observed
        with the per-parameter gradients), finish the last reduction, launch this one."""
        u = self.units[name]
        if name in self.packed or not u.packed:
            return  # no trainable parameter: nothing to pack (frozen_done reshards it after its backward)
        i = self.now[0]
        if name not in self.recomputed:  # frozen parameters share the buffer: kept
            self.reshard(name)
        self.reclaim(name)
        packed = self.key(u.packed, u.compute)
        self.pool.acquire(packed)
        self.at(i, self.unpacked(grads), ("backward", name))
        self.packing = [packed]
        self.observe()
        self.packing = []
        self.packed.add(name)
        self.at(i, self.unpacked(grads), ("backward", name))
        self.finish()
        if self.world > 1:
            self.pool.lend(packed)
        if self.world > 2:
            received = self.key(u.packed, u.reduce)
            self.pool.acquire(received)
            self.in_flight = [(name, [received, packed])]
        elif name in self.in_place:  # reduced in place, through a staging buffer of its first piece
            stage = self.key(-(-u.shard_grad // max(1, min(IN_PLACE_PIECES, u.shard_grad))), u.reduce)
            self.pool.acquire(stage)
            self.in_flight = [(name, [stage, packed])]
        else:  # at 2 ranks the other rank's chunk arrives straight in the gradient-shard buffer
            self.in_flight = [(name, [packed])]
        self.reshard(name)  # post-backward (a recomputed unit's only now, see the module docstring)
        self.drop_done_with(name)

    def frozen_done(self, name: str) -> None:
        """``name``, a unit with no trainable parameter, finished its backward (the identity on
        its inputs ran, ``hooks.hook_frozen_inputs``): it reshards, nothing to reduce."""
        if self.units[name].packed or name in self.packed:
            return
        self.packed.add(name)
        self.reshard(name)
        self.drop_done_with(name)

    def sizes(self, name: str) -> set[Key]:
        u = self.units[name]
        return {self.key(n, u.compute) for n in (u.full, u.packed, *u.scratch)}

    def drop_done_with(self, name: str) -> None:
        """When no unit still to run backward will gather, the pool frees the buffers of sizes
        only units already done use (``backward_buffers.drop_done_with``)."""
        i = self.order.index(name)
        if i == 0:
            return
        rest = [n for n in self.order[:i] if n in self.runs_backward]  # the others gather nothing until forward
        done = self.order[i:] + [n for n in self.order[:i] if n not in self.runs_backward]
        if any(
            self.units[n].full and (n not in self.gathered or n in self.pending) and n not in self.packed for n in rest
        ):
            return  # a gather still to come (a prefetch not yet waited on counts: the engine's unit is SHARDED)
        needed = {k for n in rest for k in self.sizes(n)}
        for k in {k for n in done for k in self.sizes(n)} - needed:
            self.pool.kept.pop(k, None)

    def finish(self) -> None:
        """Finish the reduction in flight: its buffers back to the pool (world > 1), the
        gradient shards cast into a fresh buffer when the reduction's dtype is not theirs
        (observed while the source still exists); at one rank the packed gradient is the
        gradient, or is freed once cast."""
        for name, keys in self.in_flight:
            u = self.units[name]
            if self.world > 1:
                for k in keys[:-1]:
                    self.pool.release(k)
                if name in self.in_place:  # the packed gradient holds the gradient shards
                    self.pool.lent[keys[-1]] -= 1
                    self.pinned[name] = keys[-1]
                else:
                    self.pool.release(keys[-1], lent=True)
            if u.reduce != u.param and not self.offload:
                self.grads += u.shard_grad * u.param
                self.observe()
            if self.world == 1:
                (packed,) = keys
                self.pool.drop(packed)
                if u.reduce == u.param:  # the packed buffer becomes the gradient, never given back
                    self.grads += packed[0] * packed[1]
        self.in_flight = []

    def reclaim(self, name: str) -> None:
        """``name``'s packed gradient that held its gradient shards goes back to the pool (they
        were dropped by ``zero_grad`` before this step)."""
        key = self.pinned.pop(name, None)
        if key is not None:
            self.pool.release(key)

    def unpacked(self, grads: tuple[int, ...]) -> int:
        """Bytes of the per-parameter gradients (``grads``: produced per unit) not yet packed."""
        return sum(grads[i] for name, i in self.index.items() if name not in self.packed)

    def end(self) -> None:
        self.finish()
        for name in list(self.gathered):
            self.reshard(name)

    # -------------------------------------------------------------- peaks
    def at(self, i: int, unpacked: int, label: tuple[str, str]) -> None:
        """The moment the next changes happen: just after sample ``i``, with ``unpacked``
        bytes of per-parameter gradients not yet packed, in phase and unit ``label``."""
        self.now = (i, unpacked, label)

    def observe(self) -> None:
        """Count the bytes alive at the current moment (:meth:`at`) toward the peak."""
        if not self.measuring:
            return
        i, unpacked, label = self.now
        flight = sum(k[0] * k[1] for _, keys in self.in_flight for k in [*keys, *self.packing])
        total = self.state + self.grads + unpacked + self.pool.bytes + self.act[i]
        if self.best is None or total > self.best.total:
            self.best = Peak(
                total,
                self.grads + unpacked,
                self.pool.bytes - flight,
                flight,
                self.act[i],
                label[0],
                label[1],
            )


def replay(
    units: list[UnitBuffers],
    samples: Sequence[tuple[int, tuple[int, ...], bool, str]],
    grad_totals: Sequence[int],
    param_bytes: int,
    world_size: int,
    *,
    sharding_strategy: str = "full_shard",
    state: int = 0,
    recomputed: Collection[str] = (),
    kept: Collection[str] = (),
    groups: Sequence[Sequence[str]] = (),
    forward_prefetch: bool = False,
    offload: bool = False,
    keep_last: bool = False,
) -> Peak:
    """The step's peak (see the module docstring) from ``samples`` of a traced step: (bytes
    alive, gradient bytes produced per unit in ``units``' order, in backward?, block running).

    ``grad_totals``: each unit's gradient bytes in the trace (all produced); ``param_bytes``:
    the traced model's parameter bytes; ``state``: shards and optimizer state (bytes), or what
    the device holds of them; ``recomputed``: the units activation checkpointing recomputes in
    backward; ``kept``: units that keep their full parameters after forward under FULL_SHARD
    (every unit does under SHARD_GRAD_OP and NO_SHARD); ``groups``: units of several blocks
    (the samples name blocks, ``units`` the first of each group); ``forward_prefetch``: each
    unit's pre-forward starts the next one's gather; ``offload``: gradient shards on the host;
    ``keep_last``: FULL_SHARD keeps the last unit of forward gathered too, as the wrapper does
    (:func:`fullshard.engine.hooks.keeps_last_gathered`; ``fully_shard`` does not).

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("replay needs the samples of a traced step")
    world = 1 if sharding_strategy == "no_shard" else world_size
    act = [alive - param_bytes - sum(grads) for alive, grads, _, _ in samples]
    unit_of = {n: g[0] for g in groups for n in g}
    names = {u.name for u in units}
    named = [unit_of.get(name, name) for _, _, back, name in samples if not back]
    ran = [n for n in dict.fromkeys(n for n in named if n in names) if n != ROOT]
    every = set([u.name for u in units] if sharding_strategy != "full_shard" else kept)
    if keep_last and sharding_strategy == "full_shard" and ran:
        every.add(ran[-1])  # the wrapper's last unit of forward (hooks.keeps_last_gathered)
    r = _Replay(units, world, every, state, act, recomputed, offload)
    r.forward_prefetch = forward_prefetch
    r.unit_of = unit_of
    r.closing = {g[-1] for g in groups}  # the block whose post-forward ends its unit's
    order = [ROOT] + ran + [n for n in r.units if n not in ran and n != ROOT]
    for measuring in (False, True):
        r.measuring = measuring
        r.start(order)
        _step(r, samples, grad_totals, order)
        r.end()
    assert r.best is not None
    return r.best


def _step(
    r: _Replay,
    samples: Sequence[tuple[int, tuple[int, ...], bool, str]],
    grad_totals: Sequence[int],
    order: list[str],
) -> None:
    """One step of the engine's hooks over ``samples`` (see :func:`replay`), units gathered
    in forward ``order`` (the root first)."""
    idx = r.index
    prev: tuple[str | None, str | None] = (None, None)  # phase, block
    last_backward = {r.unit_of.get(block, block): i for i, (_, _, back, block) in enumerate(samples) if back}
    runs_backward = r.runs_backward = set(last_backward) | {u for u in order if grad_totals[idx[u]]} | {ROOT}
    r.at(0, 0, ("forward", ROOT))
    r.gather(ROOT, wait=True)
    for i, (_, grads, back, block) in enumerate(samples):
        phase, name = "backward" if back else "forward", r.unit_of.get(block, block)
        r.at(i, r.unpacked(grads), (phase, name))
        packed = len(r.packed)
        if back:  # units whose last gradient came by now (the root's: at the end); a unit's
            # last gradients (a norm's weight) may come with the next unit's input gradient,
            # whose hook starts that unit's backward: packing comes first
            for u in reversed(order[1:]):
                if u not in r.packed and grad_totals[idx[u]] and grads[idx[u]] >= grad_totals[idx[u]]:
                    r.pack(u, grads)
        if (phase, block) != prev:
            # the moment between the last sample and this one, or after this one's
            # allocation when it brought a unit's last gradient (packed just now)
            before = i if len(r.packed) > packed else max(i - 1, 0)
            r.at(before, r.unpacked(samples[before][1]) if back else 0, (phase, name))
            if prev[0] == "forward" and prev[1] not in (None, ROOT):
                r.post_forward(prev[1])
            left = r.unit_of.get(prev[1], prev[1]) if back and prev[0] == "backward" and prev[1] else None
            if left is not None and left not in (name, ROOT) and last_backward.get(left, i) < i:
                r.frozen_done(left)  # its backward reached its inputs: it reshards before this unit gathers
            if back and prev[0] == "forward":  # the root's pre-backward prefetches the last unit of forward
                r.gather_first_of_backward(samples)
            if name != ROOT and name not in r.packed:
                r.gather(name, wait=True)
                k = order.index(name)
                # the nearest unit before it in forward order that runs backward (one whose
                # output needs no gradient is never prefetched: hook_state.backward_neighbour)
                before_it = next((u for u in reversed(order[1:k]) if u in runs_backward), None) if back else None
                if before_it is not None and before_it not in r.packed:
                    r.gather(before_it, wait=False)
                elif not back and r.forward_prefetch and k + 1 < len(order):
                    r.gather(order[k + 1], wait=False)
            prev = (phase, block)
        r.at(i, r.unpacked(grads), (phase, name))
        r.observe()
    last = len(samples) - 1
    r.at(last, r.unpacked(samples[last][1]), ("backward", ROOT))
    for u in [*reversed(order[1:]), ROOT]:
        r.pack(u, samples[last][1])


def _in_place_units(units: Sequence[UnitBuffers]) -> set[str]:
    """The units whose gradient shards stay in their packed gradient at two ranks (as
    ``engine.hooks`` marks them and ``GradReducer`` decides): every parameter trainable, no cast,
    and a full-buffer size no other pooled buffer has (another unit's, or its own scratch)."""
    count: dict[Key, int] = {}
    for u in units:
        for numel in {u.full, u.packed, *u.scratch}:
            count[(numel, u.compute)] = count.get((numel, u.compute), 0) + 1
    return {
        u.name
        for u in units
        if u.full
        and u.full == u.packed
        and u.full not in u.scratch
        and u.compute == u.reduce == u.param
        and count[(u.full, u.compute)] == 1
    }


def model_state(units: list[UnitEstimate]) -> int:
    """Shards and optimizer state of ``units`` (bytes), constant through a step."""
    return sum(u.shard_bytes + u.optim_bytes for u in units)
