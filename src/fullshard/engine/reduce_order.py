"""When a tree's units launch their gradient reductions, and in which order.

gloo and NCCL match collectives by their position in each rank's sequence, so every rank must
launch the same reductions in the same order. Ordinarily a unit reduces in its post-backward:
backward reaches the units in the same order on every rank because every rank runs the same
graph. Under ``set_reduce_scatter_unused_params(True)`` (``unit.grads.reduce_unreached``) it
need not: rank-dependent control flow (MoE experts, one modality's tower) reaches a unit on some
ranks only, and the ranks that did not reach it reduce zeros for it at backward's end, after
the units they did reach: with two units of one size, one unit's gradients would be averaged
with the other's, silently; of different sizes, the collectives fail or hang.

So in a tree where some unit has ``reduce_unreached``, every unit that reduces takes *turns* in
one fixed order, the same on every rank: the reverse of the tree's construction order
(``root.units``, which the first forward checks is every rank's; the root last). Not forward's
order, which conditional control flow makes rank-dependent. A unit whose post-backward comes
before its turn keeps its accumulated gradient (its full flat gradient, as with sync off)
and launches as soon as every unit before it has; at backward's end the rest launch in turn,
zeros for the flagged units backward did not reach. Units without the flag take turns too: a
unit reached on every rank can still come before a flagged one on one rank and after it on
another. A model that calls its units in the order it builds them reduces in backward exactly
as before (each unit's turn has come when its post-backward runs); one whose backward reaches
them in another order holds gradients longer (memory, less overlap) but reduces the same sums.

A unit's post-backward can come twice in one backward (it fires once per autograd graph task:
a unit used inside a reentrant activation-checkpointing segment and outside it). Without turns
it reduces twice, on every rank. Under turns, a rank that reached it again after its turn had
launched would reduce twice while a rank that still held it reduces once, the two sums
together. So the second gradient is held instead, and after the turns comes a *late round*:
every rank takes one small MAX all-reduce of a flag per unit ("I hold a late gradient") over
the groups the units reduce over, then every unit flagged on any rank reduces once more, in
turn order, zeros where this rank holds no late gradient: the same sums as two reductions.

Several roots can meet in one backward (``loss = dec(enc(x))``, each its own root): the other
tree's all-gathers and reductions come during this tree's backward like a resharded unit's
all-gather, so a flagged turn launched then would pair with them crosswise on ranks that did
not reach it. So where another root has run a forward whose backward may come
(:func:`others_open`; a root only ever run without grad and with no trainable parameter does
not count), the turns hold as where a unit reshards (:func:`gathers_in_backward`),
and launch at this tree's end callback, in the order the trees' backwards began on every rank.
Roots are recorded by serial, not by a live reference or ``id``, and never forgotten: when a
dropped root is collected differs per rank, the answer must not.

In a tree without the flag nothing changes: each unit reduces in its post-backward, and there
is no late round. Its ``fully_shard`` units leave a parameter no gradient reached ``.grad`` None
instead (``unused_grads_none``), and :func:`settle_unused` makes the ranks agree on which.
"""

from __future__ import annotations

import dataclasses

import torch

from fullshard.comm import collectives
from fullshard.engine.config import FrontEnd
from fullshard.engine.grad_use import GradUse
from fullshard.engine.hook_state import ReduceTurns, RootState
from fullshard.engine.unit import Unit


def launch(unit: Unit, root: RootState) -> None:
    """Launch ``unit``'s reduction, first finishing the one launched before (keep one in flight,
    not all), also when that one is ``unit``'s own (reached twice in one backward: its second
    launch would drop the first's reduction)."""
    if root.last_reduced is not None:
        root.last_reduced.finish_reduce()
    unit.reduce_grads()
    root.last_reduced = unit


def turns(root: RootState) -> ReduceTurns:
    """This backward's turns (made at its first reduction): none in a tree without
    ``reduce_unreached``; else every unit with gradient sync on and a trainable parameter,
    in reverse construction order; where some unit of the tree all-gathers in backward
    (:func:`gathers_in_backward`) or another root's backward may come in this one
    (:func:`others_open`), every turn from the first flagged unit's on waits for backward's
    end (``ReduceTurns.hold_from``)."""
    made = root.turns
    if made is None:
        units: list[Unit] = []
        if any(u.grads.reduce_unreached for u in root.units):
            units = [u for u in reversed(root.units) if u.sync_grads and u.has_trainable]
        hold_from = len(units)
        if units and (gathers_in_backward(root) or others_open(root)):
            hold_from = next((i for i, u in enumerate(units) if u.grads.reduce_unreached), len(units))
        made = root.turns = ReduceTurns(units, {id(u): i for i, u in enumerate(units)}, hold_from)
    return made


# The roots (by serial) that have run a forward whose backward may come: any forward outside
# backward with grad, or without grad where the tree has a trainable parameter (reentrant
# activation checkpointing's first pass over a whole root, or over a function whose output is a
# root's input: their recomputation and backward come inside the next backward). Never cleared
# by a backward's end: a retained graph (``retain_graph=True``, a ``create_graph`` gradient
# penalty, two losses over one encoder) runs that root's backward again after its end callback,
# with no forward in between. Nor when a root is dropped: when Python collects it differs per
# rank, and the answer must not. Only which roots the program ran counts, so the answer is every
# rank's. Read at the root's pre-forward, not from its output, which may hold no tensor a hook
# can find (a plain dataclass) while its units' outputs do.
_SEEN: set[int] = set()


def root_forward(root: RootState) -> None:
    """A forward of ``root``'s tree begins at its root, outside backward: record it where its
    backward may come (see :data:`_SEEN`) for :func:`others_open`."""
    if torch.is_grad_enabled() or any(u.has_trainable for u in root.units):
        _SEEN.add(root.serial)


def others_open(root: RootState) -> bool:
    """Whether some other root has run a forward whose backward may come (:data:`_SEEN`): in the
    same backward as ``root``'s (``dec(enc(x))``), also after its own end callback, through a
    retained graph. Only a forward outside backward changes the answer, so it is the same
    wherever in a backward the turns are made (a unit's post-backward or the end callback)."""
    return any(serial != root.serial for serial in _SEEN)


def forget_seen_roots() -> None:
    """Forget the roots seen (between tests, on every rank at once)."""
    _SEEN.clear()


def gathers_in_backward(root: RootState) -> bool:
    """Whether backward may all-gather some unit of ``root``'s tree: some unit (frozen, with
    sync off, or any other) reshards after forward over more than one rank; a root that keeps
    its full parameters into backward does not. Its settings are every rank's, so the answer is.

    Then a flagged unit's turn cannot be taken during backward. Its post-backward fires on a rank
    where some parameter of it got a gradient, and not on another (not reached there, or reached
    with no parameter used: a gate, a layer some ranks skip), which reduces zeros for it at
    backward's end: the first would launch the reduction before a resharded unit's all-gather
    and the second after it, and over one group the two would pair crosswise (of one size, with
    no error: wrong gradients). So that turn and every later one wait for the end; the turns
    before it are unflagged units, whose post-backward fires on every rank."""
    for state in root.states:
        unit = state.unit
        kept_as_root = state.is_root and (state.front_end is FrontEnd.WRAPPER or unit.auto_reshard_after_forward)
        if unit.shard_size > 1 and unit.reshard_after_forward and not kept_as_root:
            return True
    return False


def reached(unit: Unit, root: RootState) -> None:
    """``unit``'s post-backward with gradient sync on: launch its reduction if its turn has
    come (and every ready unit after it whose turn that brings), else keep its gradient for
    its turn; reached again after its reduction launched, keep the new gradient for the late
    round (:func:`_late_round`)."""
    made = turns(root)
    turn = made.turn.get(id(unit))
    if turn is None:  # no turns
        launch(unit, root)
    elif turn < made.next:  # reached again after its reduction launched
        made.late.add(id(unit))
    else:
        made.ready.add(id(unit))
        _launch_ready(made, root)


def _launch_ready(made: ReduceTurns, root: RootState) -> None:
    i = made.next
    while i < made.hold_from and id(made.units[i]) in made.ready:
        launch(made.units[i], root)
        i += 1
    made.next = i


def launch_rest(root: RootState, graph: bool) -> bool:
    """At backward's end: launch every turn not taken, in order; a flagged unit that backward
    did not reach reduces zeros (or what it held from backwards with sync off). In a backward
    that creates a graph (``graph``), an unflagged unit not reached keeps the sums it held for
    the next backward, as without turns. Returns False for a tree without turns (nothing done)."""
    made = turns(root)
    if not made.units:
        return False
    for unit in made.units[made.next :]:
        reached_now = id(unit) in made.ready
        if unit.grads.reduce_unreached and not reached_now:
            unit.grads.fill_zeros()
        if unit.has_pending_reduce or not unit.grads.holds_unreduced:
            continue
        if reached_now or unit.grads.reduce_unreached or not graph:
            launch(unit, root)
    made.next = len(made.units)
    _late_round(made, root)
    return True


def _late_round(made: ReduceTurns, root: RootState) -> None:
    """After the turns: every rank launches one more reduction, in turn order, for each unit
    reached again after its reduction launched on any rank (zeros where not on this one). The
    ranks agree on which by a MAX all-reduce of flags over the groups the units reduce over
    (the shard group, then the replicate group): one set of flags per distinct pair of groups,
    in the order the turns meet them, so each unit's flag is the same on all of its ranks."""
    late: set[int] = set()
    for groups, units in _by_groups(made.units):
        flags = torch.tensor([float(id(u) in made.late) for u in units])
        for group in groups:
            collectives.all_reduce_max(flags, group)
        late.update(id(u) for u, flag in zip(units, flags.tolist()) if flag)
    for unit in made.units:
        if id(unit) in late:
            unit.grads.fill_zeros()  # a no-op where this rank holds a late gradient
            launch(unit, root)


@dataclasses.dataclass
class _Settle:
    """The flags :func:`_start_settle` sent: per group set, the use records with how many flags
    each sent, the summed flags, the all-reduce over the first group in flight, and the groups left."""

    parts: list[
        tuple[list[tuple[GradUse, int]], torch.Tensor, collectives.Handle | None, list[collectives.ProcessGroup]]
    ]


def _start_settle(root: RootState) -> _Settle | None:
    """Once every reduction of a backward launched and before they are landed: start summing,
    over the groups the units reduce over, a flag per trainable parameter of each part of a unit
    (:mod:`.grad_use`: its flat buffer's parameters, its all-gather extension ones) that leaves
    unused parameters' ``.grad`` None (``fully_shard`` without
    ``set_reduce_scatter_unused_params``) and launched a reduction since the last settle, not
    only partial ones (``set_requires_all_reduce(False)``: those wait for the all-reduce): "a
    gradient reached it on this rank" (``GradUse.here``). None where no such unit launched one
    (on no rank, as reductions are launched on every rank). The sum runs behind the reductions
    in flight: :func:`settle_unused` waits for it."""
    units = [u for u in root.units if u.grads.unused_grads_none and any(r.settle_due for r in u.grads.uses())]
    if not units:
        return None
    parts = []
    for groups, members in _by_groups(units):
        records = [(r, len(r.here or ())) for u in members for r in u.grads.uses() if r.settle_due]
        flags = torch.tensor([float(f) for r, _ in records for f in r.here or ()])
        handle = collectives.all_reduce(flags, groups[0], async_op=True) if groups else None
        parts.append((records, flags, handle, groups[1:]))
    return _Settle(parts)


def settle_unused(root: RootState) -> None:
    """At the end of a backward, once every reduction launched: land them, and make the choice
    "``.grad`` stays None" the same on every rank. A reduction leaves a parameter without a
    gradient on a rank where backward did not use it and its reduced shard is zero
    (``GradUse.undecided``); but another rank may have used it, its gradient zero in this
    rank's rows only (an embedding's rows of tokens that rank never saw), and set ``.grad``
    there: ``clip_grad_norm_`` would then issue different collectives per rank and hang. So
    each such parameter that some rank used (flags summed behind the reductions in flight,
    :func:`_start_settle`) gets zeros here, and its post-accumulate-grad hooks run; one no rank
    used keeps None everywhere. A unit that launched while landing (an ``ExtensionUnit``'s part
    that never reported, in a backward that creates a graph) takes a second round, blocking,
    on every rank alike."""
    started = _start_settle(root)
    for u in root.units:
        u.finish_reduce()
    for settle in (started, _start_settle(root)):
        _agree(settle)


def _agree(started: _Settle | None) -> None:
    """Wait for ``started``'s sums, and give zeros where another rank used a parameter."""
    if started is None:
        return
    for records, flags, handle, rest in started.parts:
        if handle is not None:
            handle.wait()
        for group in rest:
            collectives.all_reduce(flags, group)
        used = flags.tolist()
        for record, n in records:
            mine, used = used[:n], used[n:]
            record.agree(mine)


def _by_groups(units: list[Unit]) -> list[tuple[list[collectives.ProcessGroup], list[Unit]]]:
    """``units`` by the groups they reduce over (their shard group, then their replicate group,
    those of more than one rank), in the order ``units`` meet them."""
    meshes: dict[tuple[int, ...], tuple[list[collectives.ProcessGroup], list[Unit]]] = {}
    for u in units:
        sizes = ((u.shard_group, u.shard_size), (u.replicate_group, u.replicate_size))
        groups = [g for g, n in sizes if g is not None and n > 1]
        meshes.setdefault(tuple(map(id, groups)), (groups, []))[1].append(u)
    return list(meshes.values())
