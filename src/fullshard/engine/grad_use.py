"""Which trainable parameters a gradient reached on this rank: the record behind ``unused_grads_none``.

``fully_shard`` (torch FSDP2's rule) leaves a parameter no backward reached with ``.grad`` None
instead of a zero. The ranks must agree on which: a reduction still packs a zero gradient for a
parameter this rank did not use (the collectives' sizes are every rank's), and leaves its
``.grad`` None for now where the reduced shard is zero; :func:`.reduce_order.settle_unused`
sums the flags "used here" over the ranks at the end of backward and gives zeros where another
rank used it. One :class:`GradUse` per part of a unit that reduces on its own: the flat buffer's
trainable parameters (:mod:`.reduce`), the all-gather extension parameters
(:mod:`.extension_reduce`). Indices are the part's trainable parameters, in its order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass
class GradUse:
    """The use record of one part of a unit.

    Attributes:
        give_zero: gives trainable parameter ``i`` a zero ``.grad`` and runs its
            post-accumulate-grad hooks (the settle's zeros).
        noted: per trainable parameter, a gradient reached it since the last launch (None: none
            recorded, as after a launch).
        here: per trainable parameter, a gradient reached it in some reduction launched since the
            last settle (None: none launched since).
        undecided: the indices the last reduction left without a ``.grad`` (no gradient here, a
            zero shard), until the settle gives those another rank used zeros.
        settle_due: a reduction since the last settle took every rank's sum (not a partial
            reduce, which waits for the replica all-reduce).
    """

    give_zero: Callable[[int], None]
    noted: list[bool] | None = None
    here: list[bool] | None = None
    undecided: set[int] = dataclasses.field(default_factory=set)
    settle_due: bool = False

    def note(self, used: Sequence[bool]) -> None:
        """Record which trainable parameters got a gradient (one flag per parameter)."""
        noted = self.noted
        if noted is None:
            self.noted = list(used)
        elif not all(noted):
            self.noted = [a or b for a, b in zip(noted, used)]

    def take(self) -> list[bool] | None:
        """For a launch: the flags noted since the last one, None where each parameter got a
        gradient (none is left without one) or nothing was noted; the record starts afresh."""
        used, self.noted = self.noted, None
        return None if used is None or all(used) else used

    def launched(self, used: list[bool] | None, n: int, settle_due: bool) -> None:
        """A reduction of ``n`` trainable parameters launched with ``used`` (:meth:`take`'s);
        afresh where the trainable count changed since the last settle."""
        seen = self.here if self.here is not None and len(self.here) == n else [False] * n
        self.here = [a or b for a, b in zip(seen, used or [True] * n)]
        self.settle_due = self.settle_due or settle_due

    def agree(self, used: Sequence[float]) -> None:
        """The settle's sums of :attr:`here` over the ranks: zeros for each undecided parameter
        some rank used; the record starts afresh."""
        for i in sorted(self.undecided):
            if i < len(used) and used[i]:
                self.give_zero(i)
        self.undecided, self.here, self.settle_due = set(), None, False

    def drop(self) -> None:
        """Forget everything recorded (an aborted iteration's)."""
        self.noted = self.here = None
        self.undecided, self.settle_due = set(), False


def unused_here(used: list[bool] | None, shards: Sequence[torch.Tensor]) -> set[int]:
    """Indices of the parameters no gradient reached on this rank (``used``: a launch's flags)
    whose reduced shard (``shards``, one per parameter) is all zeros: a ``.grad`` they lack
    stays None for now (another rank may have used one: the settle asks)."""
    if used is None:
        return set()
    return {i for i, (u, g) in enumerate(zip(used, shards)) if not u and not bool(g.any())}
