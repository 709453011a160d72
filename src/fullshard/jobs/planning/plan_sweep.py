"""``fullshard bench plan --sweep N --seed S``: the planner on model/budget pairs nobody picked.

Models: the first ``ceil(N / 2)`` configurations the estimator sweep's generator draws from seed
``S`` (:func:`~fullshard.jobs.planning.sweep.draw`): their family, shape, batch, sequence length
and precision. The drawn sharding, activation checkpointing and front end are what the planner
and the hand configurations choose, so they are not used, and every pair runs at
:data:`WORLD` ranks (gloo). Budgets: two per model, drawn from ``random.Random(f"plan-budgets/{S}")``
(:func:`pairs`): a *tight* one, what the smallest candidate needs under the planner's margin
(:meth:`~fullshard.plan.planner.Plan.needs`) and ``u`` more, ``u`` uniform in [0, 10%): the least
budgets the planner takes; and a *drawn* one, uniform between the smallest and the largest
candidate's predicted peak (below what the smallest needs, the planner refuses: reported).

Each model: :data:`WORLD` fresh processes calibrate, rank 0 scores every candidate once and
plans each budget (:func:`~fullshard.plan.planner.choose`), then the plans and the six hand
configurations (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, each without and with activation
checkpointing on every block) are measured as ``fullshard bench plan`` measures its own
(:func:`~fullshard.jobs.planning.plan_bench.measure_all`: all built at once, taking turns step
by step, the median of ``rounds`` x 10 steps; rank 0's third-step peak of live tensor bytes),
training with fused AdamW on random batches.
Reported per pair: the plan, its predicted and measured peak, whether it fits its budget, its
step (wall time) over the fastest hand configuration that fits the budget measured, and its
process CPU time per step over the least of the fitting hands' (what other sessions' load on a
shared machine does not change; waiting for the other rank excluded).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from fullshard.jobs import launch
from fullshard.jobs.planning import families
from fullshard.jobs.planning.plan_bench import Workload, hand_configurations, measure_all
from fullshard.jobs.planning.sweep import Config, draw
from fullshard.plan.margin import MARGIN_FROM, MARGIN_KEPT_FROM, MIB
from fullshard.plan.planner import Scored, choose, plan

WORLD = 2
TIGHT_ABOVE = 0.10  # a tight budget is at most this share above what the smallest candidate needs


def pairs(seed: int, n: int) -> list[tuple[Config, str, float]]:
    """``n`` (model, budget kind, fraction) pairs from ``seed``: models two by two from
    :func:`~fullshard.jobs.planning.sweep.draw`, each with a ``"tight"`` budget (fraction in
    [0, :data:`TIGHT_ABOVE`)) and a ``"drawn"`` one (fraction in [0, 1)); see the module note.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n={n}: draw at least one model/budget pair")
    rng = random.Random(f"plan-budgets/{seed}")
    out = []
    for c in draw(seed, math.ceil(n / 2)):
        out += [(c, "tight", rng.uniform(0.0, TIGHT_ABOVE)), (c, "drawn", rng.random())]
    return out[:n]


def budget_of(scored: list[Scored], kind: str, fraction: float, leftover: int = 0) -> int:
    """The budget (bytes per rank) of a ``kind`` ("tight" or "drawn") pair at ``fraction`` for
    the candidates ``scored``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    everything = choose(scored, 2**62, leftover=leftover)
    if kind == "tight":
        return math.ceil(everything.needs(everything.smallest) * (1 + fraction))
    if kind == "drawn":
        peaks = [s.peak.total for s in scored]
        return int(min(peaks) + fraction * (max(peaks) - min(peaks)))
    raise ValueError(f"kind={kind!r}: use 'tight' or 'drawn'")


def _plans(scored: list[Scored], budgets: list[tuple[str, float]], leftover: int) -> list[dict[str, Any]]:
    """Rank 0's plan per (kind, fraction): the budget, the candidate (None: refused), its
    predicted peak (bytes) and step (seconds), and what the smallest candidate needs."""
    rows = []
    for kind, fraction in budgets:
        budget = budget_of(scored, kind, fraction, leftover)
        p = choose(scored, budget, leftover=leftover)
        best = p.best
        rows.append(
            {
                "kind": kind,
                "budget": budget,
                "plan": best.candidate if best is not None else None,
                "predicted": (best.peak.total, best.step.seconds) if best is not None else None,
                "smallest_needs": p.needs(p.smallest),
            }
        )
    return rows


def _worker(c: Config, budgets: list[tuple[str, float]], rounds: int) -> dict[str, Any] | None:
    device = launch.init_process_group()
    try:
        return measure_model(c, budgets, rounds, device)
    finally:
        launch.destroy_process_group()


def measure_model(c: Config, budgets: list[tuple[str, float]], rounds: int, device: torch.device) -> dict[str, Any]:
    """On every rank of a started process group: calibrate, plan each (kind, fraction) budget of
    model ``c`` (rank 0 plans, every rank gets the plans) and measure the plans and the hand
    configurations. Returns ``{"rows": [...], "hands": {name: (seconds, peak bytes)},
    "hands_predicted": {name: step seconds}}``, each row with its ``kind``, ``budget`` (bytes),
    ``plan`` (a Candidate, None: refused), ``predicted`` (peak bytes, step seconds),
    ``smallest_needs`` (bytes) and ``measured`` ((seconds, this rank's peak bytes, CPU seconds)
    or None)."""
    from fullshard.comm import collectives
    from fullshard.plan.steptime import calibrate

    make, example, loss_fn, is_unit = families.parts(c.family, c.shape, c.batch, c.seq)
    dtype = torch.bfloat16 if c.precision == "bf16" else None
    cal = calibrate(make, example, loss_fn, is_unit, device, compute_dtype=dtype, optimizer="adamw")
    group = collectives.default_group()
    hands = hand_configurations(tuple(n for n in cal.blocks if n != "<root>"))
    planned_on_0 = None
    if collectives.group_rank(group) == 0:
        scored = plan(cal, make, example, loss_fn, is_unit, 2**62, param_dtype=dtype).scored
        by_candidate = {s.candidate: s.step.seconds for s in scored}
        planned_on_0 = _plans(scored, budgets, cal.leftover_bytes), {n: by_candidate[h] for n, h in hands.items()}
    rows, hands_predicted = collectives.broadcast_object(planned_on_0, 0, group)
    work = Workload(
        make,
        lambda: families.random_batch(c.family, example, c.shape.vocab, c.shape.classes),
        loss_fn,
        dtype,
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    )
    planned = [r["plan"] for r in rows if r["plan"] is not None]
    by_cand = measure_all([*hands.values(), *planned], work, device, rounds)
    for r in rows:
        r["measured"] = by_cand[r["plan"]] if r["plan"] is not None else None
    return {"rows": rows, "hands": {name: by_cand[h] for name, h in hands.items()}, "hands_predicted": hands_predicted}


def _line(
    c: Config, r: dict[str, Any], hands: dict[str, tuple], hands_predicted: dict[str, float] | None = None
) -> tuple[str, float | None, float | None]:
    """The pair's table line, its step ratio to the fastest fitting hand and its CPU-time ratio to
    the fitting hand of least CPU time (None: no ratio); steps as predicted / measured where
    ``hands_predicted`` (hand name -> predicted seconds) is given. A measurement is (wall
    seconds, peak bytes[, CPU seconds])."""
    budget = r["budget"]
    fitting = {n: m for n, m in hands.items() if m[1] <= budget}
    fastest = min(fitting.items(), key=lambda kv: kv[1][0]) if fitting else None
    hand = "none fits"
    if fastest is not None:
        guess = (hands_predicted or {}).get(fastest[0])
        hand = (
            f"{fastest[0]} " + (f"{1e3 * guess:,.1f} / " if guess is not None else "") + f"{1e3 * fastest[1][0]:,.1f}"
        )
    model = c.describe().split(" | ")[0] + f" {c.precision}"
    if r["plan"] is None:
        refused = f"refused (needs {r['smallest_needs'] / MIB:,.2f})"
        return f"| {model} | {r['kind']} {budget / MIB:,.2f} | {refused} | - | - | - | {hand} | - | - |", None, None
    seconds, peak, *cpu = r["measured"]
    ratio = seconds / fastest[1][0] if fastest else None
    least_cpu = min((m[2] for m in fitting.values() if len(m) > 2), default=None)
    cpu_ratio = cpu[0] / least_cpu if cpu and least_cpu else None
    shown = f"{ratio:.2f}" if ratio is not None else "-"
    shown_cpu = f"{cpu_ratio:.2f}" if cpu_ratio is not None else "-"
    predicted, step = r["predicted"][0] / MIB, f"{1e3 * r['predicted'][1]:,.1f} / {1e3 * seconds:,.1f}"
    fits = "yes" if peak <= budget else "**NO**"
    peaks = f"{predicted:,.2f} / {peak / MIB:,.2f}"
    cells = [model, f"{r['kind']} {budget / MIB:,.2f}", r["plan"].describe(), peaks, fits, step, hand, shown, shown_cpu]
    return "| " + " | ".join(cells) + " |", ratio, cpu_ratio


HEADER = [
    "| model | budget (MiB) | plan | peak predicted / measured (MiB) | fits | plan step predicted / measured (ms) "
    "| fastest fitting hand, predicted / measured (ms) | plan / hand (measured) | plan / hand (CPU time) |",
    "|---|---|---|---|---|---|---|---|---|",
]


def report(seed: int, n: int, rounds: int = 2) -> Iterator[str]:
    """Draw ``n`` pairs from ``seed``, plan and measure each; yields markdown lines as they come
    (the table, then the summary)."""
    yield f"Seed {seed}, {n} model/budget pairs (`fullshard bench plan --sweep {n} --seed {seed}`), {WORLD} ranks."
    kept = MARGIN_KEPT_FROM.describe()
    yield f"The planner's {MARGIN_FROM.describe()}; for NO_SHARD and SHARD_GRAD_OP throughout, {kept}.\n"
    yield from HEADER
    drawn = pairs(seed, n)
    models = list(dict.fromkeys(c for c, _, _ in drawn))
    fits: list[bool] = []
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    refused: list[str] = []
    failed: list[str] = []
    start = time.perf_counter()
    for c in models:
        budgets = [(kind, f) for m, kind, f in drawn if m == c]
        try:
            result = launch.launch(_worker, (c, budgets, rounds), WORLD, env=launch.BENCH_ENV)[0]
        except launch.WorkerFailed as err:
            failed.append(f"{c.describe()}: {str(err)[:160]}")
            yield f"| {c.describe()} | {len(budgets)} budgets | failed: {str(err)[:120]} | - | - | - | - | - | - |"
            continue
        assert result is not None
        for r in result["rows"]:
            line, ratio, cpu_ratio = _line(c, r, result["hands"], result.get("hands_predicted"))
            yield line
            if r["plan"] is None:
                any_hand = any(m[1] <= r["budget"] for m in result["hands"].values())
                refused.append(f"{c.describe()} {r['kind']}" + (" (a hand configuration fit)" if any_hand else ""))
                continue
            fits.append(r["measured"][1] <= r["budget"])
            if ratio is not None:
                ratios.append(ratio)
            if cpu_ratio is not None:
                cpu_ratios.append(cpu_ratio)
    yield ""
    yield from summary(fits, ratios, refused, failed, cpu_ratios)
    yield f"\n{len(models)} models, {time.perf_counter() - start:.0f} s in all."


def summary(
    fits: list[bool], ratios: list[float], refused: list[str], failed: list[str], cpu_ratios: list[float] | None = None
) -> Iterator[str]:
    """Fit rate, step-ratio distributions (wall time; CPU time where given), refusals and
    failures as markdown lines."""
    yield f"Plans that fit their budget measured: {sum(fits)} of {len(fits)}."
    for what, values in (("step", ratios), ("CPU time", cpu_ratios or [])):
        if values:
            within = sum(r <= 1.05 for r in values)
            yield (
                f"Plan {what} / fastest fitting hand {what}: max {max(values):.2f}, median "
                f"{statistics.median(values):.2f}, min {min(values):.2f}; within 5% (or faster) in {within} of "
                f"{len(values)}."
            )
    yield f"Refused (nothing fits under the margin): {len(refused)}" + (": " + "; ".join(refused) if refused else ".")
    yield f"Failed models: {len(failed)}" + (": " + "; ".join(failed) if failed else ".")
