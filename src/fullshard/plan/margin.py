"""The planner's margin: how much larger than predicted a step's peak has been measured.

The estimator's error was measured on a generated sweep (``fullshard bench estimate --sweep 40
--seed 4242``, written down in ``docs/estimate_sweep_seed4242.md``): :data:`SWEEP_ERRORS` holds
that table's signed errors, (predicted - measured) / measured, of every configuration that was
both predicted and measured, in the table's order (the one failed run left out). A plan must
hold even for the worst under-estimate seen there: a predicted peak ``p`` may measure
``p / (1 + worst)``, so the planner keeps ``1 / (1 + worst) - 1`` of the prediction free
(:data:`MARGIN`). When the estimator changes and the sweep is run again, this table is replaced
by the new run's, and the margin follows; ``tests/test_plan_fit.py`` checks that the table is
the document's.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ErrorDistribution:
    """Signed errors (fractions, predicted / measured - 1) of one estimator sweep, with where they
    were measured (``source``: the document, ``seed``: the sweep's seed, ``commit``: the code)."""

    errors: tuple[float, ...]
    source: str
    seed: int
    commit: str

    @property
    def worst_under(self) -> float:
        """The most negative error (a fraction; 0.0 when nothing was under-estimated)."""
        return min(0.0, *self.errors)

    @property
    def margin(self) -> float:
        """The share of a prediction to keep free so that the worst under-estimate still fits:
        ``1 / (1 + worst_under) - 1``."""
        return 1.0 / (1.0 + self.worst_under) - 1.0

    def describe(self) -> str:
        """One line, e.g. ``margin 21.7%: the estimator's worst under-estimate on sweep seed 4242
        (docs/estimate_sweep_seed4242.md, 39 configurations) was -17.8%``."""
        return (
            f"margin {100 * self.margin:.1f}%: the estimator's worst under-estimate on sweep seed {self.seed} "
            f"({self.source}, {len(self.errors)} configurations) was {100 * self.worst_under:+.1f}%"
        )


# docs/estimate_sweep_seed4242.md, the table's error column, rows 0-39 without row 7 (its run failed), in %.
_SEED_4242 = (
    -17.1, +29.5, +10.5, +4.1, -10.7, +18.8, +0.0, -1.1, -17.8, -1.4,
    +5.5, -0.0, +0.3, -0.4, -0.0, -12.0, +0.7, -2.9, -13.1, +0.5,
    +0.0, +24.7, -1.6, -5.6, -11.9, +6.2, +20.5, +2.6, +8.8, -1.1,
    +1.0, -3.3, -0.6, -0.4, -0.0, +30.6, +44.3, +7.7, -0.8,
)  # fmt: skip

SWEEP_ERRORS = ErrorDistribution(tuple(e / 100 for e in _SEED_4242), "docs/estimate_sweep_seed4242.md", 4242, "c5ab931")
"""The estimator's measured error distribution the planner's margin comes from."""

MARGIN = SWEEP_ERRORS.margin
"""The share of a candidate's predicted peak the planner keeps free under the budget."""
