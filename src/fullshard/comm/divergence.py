"""Ranks whose collectives stop pairing up are caught before the backend runs the mismatched one.

Every collective has an identity: op, dtype, element count, and the FSDP unit and phase that
issued it (:meth:`~fullshard.comm.flight_recorder.Entry.identity`; the step and the bytes are
reported, not compared, and so is the phase of a unit's collective: :func:`same_exchange`). An
SPMD program issues the same collectives in the same order on every rank. When it does not (a
rank that steps and calls ``state_dict()`` alone, clips alone, skips a unit, runs an extra
forward), the backend pairs one rank's collective #N with another's different
#N: of another size, gloo aborts the process in C++; of the same size, they exchange the wrong
data and hang later.

Asking the other ranks before every collective would cost a round trip each. Instead each rank
predicts its next collective on each group: the one that followed its previous two collectives
the last time those two were issued in a row. Ranks whose collectives matched up to #N-1 have made the same
predictions, so when they differ at #N, at least one of them issues something it did not
predict. Only then does a rank ask the others, through the store (:mod:`fullshard.comm.peers`),
for the identity of their #N (their watchdog thread answers once their main thread has issued
it), before it issues its own. A mismatch raises :class:`~fullshard.comm.peers.CollectiveDiverged`
on this rank, naming both collectives and which rank left the usual order, and stops every other rank
with the same message. In a training loop only the first step, and the first time of anything
new (a state dict, an evaluation), asks. It runs while the watchdog runs.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from fullshard.comm import peers
from fullshard.comm.flight_recorder import RECORDER, REQUIRES_GRAD_CHECK, Entry

Identity = tuple[Any, ...]
_MAX_LINKS = 1 << 16  # predictions kept per rank

_OP_NAMES = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "all_reduce": "all-reduce",
    "all_reduce_max": "max all-reduce",
    "broadcast": "broadcast",
    "all_gather_object": "object all-gather",
    "broadcast_object": "object broadcast",
    "barrier": "barrier",
}


class Guard:
    """This rank's predictions per group, and the questions it asks when one fails."""

    def __init__(self, channel: peers.Channel) -> None:
        self.channel = channel
        self.last: dict[str, tuple[Identity | None, Identity | None]] = {}  # group -> its last two identities
        self.after: dict[tuple[Any, ...], Identity] = {}  # (group, last two) -> the next identity
        self.tickets = itertools.count(1)
        self.asked_at = 0.0  # time.monotonic() of the last question (the watchdog polls faster after)

    def check(self, e: Entry) -> None:
        """Before ``e`` (already recorded) goes to the backend: ask the other ranks of its group
        unless it is the predicted one.

        Raises:
            CollectiveDiverged: another rank issued a different collective #``e.seq``.
            CollectiveFailed: another rank of the group exited before issuing it.
            CollectiveError: the watchdog stopped this rank while it waited for an answer.
        """
        key = e.identity()
        before = self.last.get(e.group, (None, None))
        link = (e.group, *before)
        self.last[e.group] = (before[1], key)
        if self.after.get(link) == key:
            return
        if len(self.after) > _MAX_LINKS:  # a program whose collectives never repeat: start over
            self.after.clear()
        self.confirm(e, self.after.get(link))  # with the predictions every rank shares (the same history up to #N-1)
        self.after[link] = key

    def confirm(self, e: Entry, usual: Identity | None = None) -> None:
        """Ask every other rank of ``e``'s group for its collective #``e.seq`` and compare;
        ``usual``: the collective that followed the last two before (None: none seen yet)."""
        me = self.channel.rank
        self.asked_at = time.monotonic()
        asked = {}
        try:
            for r in (int(x) for x in e.group.split(",")):
                if r != me:
                    asked[r] = next(self.tickets)
                    ask = {"kind": "ask", "from": me, "ticket": asked[r], "group": e.group, "seq": e.seq}
                    self.channel.send(r, ask)
        except Exception:  # the store is unreachable (its host exited): the backend will say what failed
            return
        for r, ticket in asked.items():
            theirs = self.await_reply(r, ticket, e)
            if theirs is not None and not same_exchange(tuple(theirs["identity"]), e.identity()):
                message = self.message(e, r, theirs, usual)
                RECORDER.complete(e, "diverged")
                error = peers.raising(peers.CollectiveDiverged(message))
                self.channel.tell_others({"kind": "stop", "error": "diverged", "message": message})
                raise error

    def await_reply(self, rank: int, ticket: int, e: Entry) -> dict[str, Any] | None:
        """Rank ``rank``'s reply (None: its ring no longer holds #N, or the store is unreachable);
        polls the store, stopping if this rank is told to stop or ``rank`` exits first."""
        pause, next_look = 0.0001, time.monotonic() + 0.5
        while True:
            try:
                arrived, reply = self.channel.reply(ticket)
            except Exception:  # the store is unreachable: nothing to compare with
                return None
            if arrived:
                return reply
            peers.raise_stop()
            if time.monotonic() > next_look:
                next_look = time.monotonic() + 0.5
                hb = self.channel.heartbeat(rank)
                if hb is not None and peers.exited(hb):
                    RECORDER.complete(e, "failed")
                    raise peers.CollectiveFailed(
                        f"rank {self.channel.rank}: {e.describe()} cannot run: rank {rank} exited "
                        f"({peers.last_completed(hb)})"
                    )
            time.sleep(pause)
            pause = min(pause * 2, 0.001)  # the other rank answers within ~1 ms once it issued #N

    def message(self, e: Entry, rank: int, theirs: dict[str, Any], usual: Identity | None = None) -> str:
        """``ranks diverged at collective #N of group [..]: rank A issued ..., rank B issued ...``
        (lower rank first, so every rank words it the same), and which rank left the usual order."""
        mine = {"identity": list(e.identity()), "nbytes": e.nbytes, "step": e.step}
        pair = sorted([(self.channel.rank, mine), (rank, theirs)], key=lambda x: x[0])
        issued = ", ".join(f"rank {r} issued {_what(d)}" for r, d in pair)
        head = f"ranks diverged at collective #{e.seq} of group [{e.group}]: {issued}"
        return f"{head}; {self.skipped(pair, usual)}"

    def skipped(self, pair: list[tuple[int, dict[str, Any]]], usual: Identity | None = None) -> str:
        """Which of the two ranks left the usual order: the one at the later step; else, when
        one of them issued the collective that usually comes next (``usual``), the other one.
        One rank reduce-scattering where the other does not points at ``no_sync``."""
        (_, a), (_, b) = pair
        hint = "rank-dependent control flow around FSDP units or collectives?"
        ops = {d["identity"][0] for _, d in pair}
        if any(d["identity"][4] == REQUIRES_GRAD_CHECK for _, d in pair):
            hint = (
                "requires_grad changed on some ranks only (requires_grad_() in rank-dependent code?): every rank "
                "must freeze or unfreeze the same parameters before the same forward"
            )
        elif "reduce_scatter" in ops and len(ops) > 1:
            hint = (
                "one rank reduce-scatters gradients where the other does not: no_sync() or "
                "set_requires_gradient_sync(False) on one rank only, or rank-dependent control flow?"
            )
        if a["step"] != b["step"]:
            (r, x), (_, y) = (pair[0], pair[1]) if a["step"] > b["step"] else (pair[1], pair[0])
            return f"rank {r} skipped ahead (step {x['step']} against step {y['step']}): {hint}"
        on_course = [r for r, d in pair if usual is not None and tuple(d["identity"]) == usual]
        if len(on_course) == 1:
            off = next(r for r, _ in pair if r != on_course[0])
            usually = f"rank {on_course[0]}'s collective is the one that usually comes next"
            return f"rank {off} left the usual order ({usually}): {hint}"
        return hint


def same_exchange(a: Identity, b: Identity) -> bool:
    """Whether two ranks' collectives #N, by identity, exchange the same data: equal, or one FSDP
    unit's (op, dtype and element count equal) from different phases. A unit all-gathered in a
    recomputation's forward on one rank and in backward on another (a reentrant checkpoint on
    some ranks only), or reduce-scattered in post-backward and at backward's end, moves the same
    shards either way. Not the requires_grad check, which only looks like an all-gather."""
    if a == b:
        return True
    return a[3] is not None and a[:4] == b[:4] and REQUIRES_GRAD_CHECK not in (a[4], b[4])


def _what(d: dict[str, Any]) -> str:
    """``state_dict all-gather of unit 'layers.0' (544 bytes, step 3)``."""
    op, _dtype, _numel, unit, phase = d["identity"]
    if op == "start":  # collectives.mark_start: torch's collectives follow
        return f"start of {phase} (step {d['step']})"
    name = _OP_NAMES.get(op, op)
    of = "" if unit is None else (" of the root" if unit == "" else f" of unit {unit!r}")
    if phase and phase.endswith(name):  # "post-backward reduce-scatter": the phase names the op already
        name, phase = phase, None
    return f"{phase + ' ' if phase else ''}{name}{of} ({d['nbytes']} bytes, step {d['step']})"


def reply_for(group: str, seq: int) -> tuple[bool, dict[str, Any] | None]:
    """(ready, reply) to an ask for this rank's collective ``seq`` of ``group``: not ready until
    the main thread has issued it; the reply is None if the ring no longer holds it."""
    if RECORDER.seq.get(group, 0) < seq:
        return False, None
    e = RECORDER.find(group, seq)
    if e is None:
        return True, None
    return True, {"identity": list(e.identity()), "nbytes": e.nbytes, "step": e.step}
