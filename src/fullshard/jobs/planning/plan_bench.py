"""``fullshard bench plan``: the planner's choice against hand configurations, measured.

For each workload (compute-bound GPT, memory-bound GPT, MNIST, transformers' Llama; 2 ranks) and
budget (ample: twice the largest hand configuration's predicted peak; tight: 1.1 x what the
candidate with the smallest predicted peak needs under the planner's margin), ``world`` fresh
processes calibrate and plan; then the planned configuration and the six hand configurations
(FULL_SHARD per block, SHARD_GRAD_OP per block, NO_SHARD, each with and without activation
checkpointing) are each built from the same seed, applied with
:meth:`~fullshard.plan.candidate.Candidate.apply`, and measured (:func:`measure_all`): all
built at once, taking turns step by step, the median of 30 steps after 2 warm-up steps; and the
third step's peak of live tensor bytes on rank 0 (a separate build under
:class:`~fullshard.plan.tracker.LiveTensorBytes`, which slows steps down).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fullshard.comm import buffers, collectives
from fullshard.jobs import launch
from fullshard.jobs.planning.validate import Config, _parts, optimizer_of
from fullshard.plan.candidate import Candidate
from fullshard.plan.planner import needs, plan
from fullshard.plan.steptime import calibrate
from fullshard.plan.tracker import LiveTensorBytes

WORKLOADS = {
    "compute-bound GPT (tiny, 16 x 128 tokens)": Config("gpt-tiny", 2, batch=16),
    "memory-bound GPT (d 512 x 4 layers, 2 x 128 tokens)": Config("gpt-wide", 2, batch=2),
    "MNIST Net (64 images)": Config("mnist", 2, batch=64),
    "transformers Llama (llama-tiny, 8 x 128 tokens)": Config("llama-tiny", 2, batch=8),
}


def hand_configurations(names: tuple[str, ...]) -> dict[str, Candidate]:
    """The six hand configurations for units ``names``."""
    out = {}
    for ac in ((), names):
        suffix = " +AC" if ac else ""
        out["FULL_SHARD" + suffix] = Candidate(False, (), ac, False, names)
        out["SHARD_GRAD_OP" + suffix] = Candidate(False, names, ac, False, names)
        out["NO_SHARD" + suffix] = Candidate(True, (), ac, False, names)
    return out


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a measured configuration trains: the unwrapped model (``make``), a real batch
    (``batch()``: random tokens or images shaped as the planner's example), the loss of
    ``(model, batch)``, the mixed-precision dtype (None: float32) and the optimizer's factory
    (parameters -> optimizer)."""

    make: Callable[[], nn.Module]
    batch: Callable[[], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    param_dtype: torch.dtype | None
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def workload(c: Config) -> Workload:
    """The fixed benchmark's workload for ``c`` (its job's optimizer, tokens in [0, 10))."""
    make, example, loss_fn, _ = _parts(c)
    opt_cls: Any = torch.optim.AdamW if optimizer_of(c) == "adamw" else torch.optim.Adadelta
    dtype = torch.bfloat16 if c.precision == "bf16" else None
    return Workload(
        make, lambda: tuple(t.random_(0, 10) for t in example()), loss_fn, dtype, lambda ps: opt_cls(ps, lr=1e-3)
    )


def _build(w: Workload, cand: Candidate, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device(device):
        model = cand.apply(w.make(), w.param_dtype)
    return model, w.optimizer(model.parameters())


def _step(w: Workload, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one training step on a fresh batch (the batch made
    before the clocks start)."""
    batch = w.batch()
    start, cpu = time.perf_counter(), time.process_time()
    w.loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def peak(w: Workload, cand: Candidate, device: torch.device) -> int:
    """This rank's third-step peak of live tensor bytes of ``cand`` (a build of its own, under
    :class:`~fullshard.plan.tracker.LiveTensorBytes`, which slows steps down)."""
    # The pool's scratch buffers would otherwise outlive the timed builds unseen by the tracker
    # (it sees storages made while it is entered): the tracked build makes its own.
    buffers.POOL.clear()
    with LiveTensorBytes() as live:
        model, opt = _build(w, cand, device)
        for _ in range(3):
            live.reset_peak()
            _step(w, model, opt)
    return live.peak


STEPS_PER_ROUND = 10  # timed steps of each candidate per round


def measure_all(cands: list[Candidate], w: Workload, device: torch.device, rounds: int = 3) -> dict[Candidate, Any]:
    """(seconds, peak bytes, CPU seconds) of each distinct candidate on this rank. Seconds: the
    median wall time of ``rounds`` x :data:`STEPS_PER_ROUND` steps after two warm-up steps,
    every candidate built at once and the candidates taking turns step by step, so that the slow
    moments of a shared machine (on this 2-core machine the same configuration measured 142 and
    219 ms minutes apart, and under other sessions' load the ranking of two configurations
    measured one after the other flipped from one minute to the next) fall on all of them alike;
    CPU seconds: the median of the same steps' process CPU time (compute, the engine's work and
    gloo's threads; what other processes' load does not change, waiting excluded); peak: the
    third step's peak of live tensor bytes (:func:`peak`). A plan that equals a hand
    configuration is that configuration's measurement."""
    distinct = list(dict.fromkeys(cands))
    built = [_build(w, cand, device) for cand in distinct]
    times: list[list[tuple[float, float]]] = [[] for _ in distinct]
    for i in range(2 + rounds * STEPS_PER_ROUND):
        for (model, opt), kept in zip(built, times):
            seconds = _step(w, model, opt)
            if i >= 2:
                kept.append(seconds)
    del built
    out = {}
    for cand, ts in zip(distinct, times):
        wall, cpu = statistics.median(t for t, _ in ts), statistics.median(c for _, c in ts)
        out[cand] = (wall, peak(w, cand, device), cpu)
    return out


def _worker(c: Config) -> list[dict[str, Any]] | None:
    device = launch.init_process_group()
    try:
        make, example, loss_fn, is_unit = _parts(c)
        cal = calibrate(make, example, loss_fn, is_unit, device, optimizer=optimizer_of(c))
        names = tuple(n for n in cal.blocks if n != "<root>")
        hands = hand_configurations(names)
        every = {s.candidate: s for s in plan(cal, make, example, loss_fn, is_unit, 2**60).scored}
        largest = max(every[h].peak.total for h in hands.values())
        smallest = min(s.peak.total for s in every.values())
        rows = []
        for label, budget in (("ample", 2 * largest), ("tight", int(1.1 * needs(smallest)))):
            chosen = plan(cal, make, example, loss_fn, is_unit, budget).best
            assert chosen is not None  # the smallest candidate fits 1.1 x what it needs
            cand = collectives.broadcast_object(chosen.candidate, 0, collectives.default_group())
            rows.append({"budget": label, "bytes": budget, "plan": cand, "predicted": chosen})
        by_cand = measure_all([*hands.values(), *(row["plan"] for row in rows)], workload(c), device)
        for row in rows:
            row["measured"] = by_cand[row["plan"]]
        measured = {name: by_cand[cand] for name, cand in hands.items()}
        return [{"hands": measured, "predicted_hands": {n: every[h] for n, h in hands.items()}, "rows": rows}]
    finally:
        launch.destroy_process_group()


def report(workloads: dict[str, Config] | None = None) -> list[str]:
    """Markdown lines: per workload and budget, the plan and every hand configuration, measured."""
    mib = 2**20
    lines = []
    for title, c in (workloads or WORKLOADS).items():
        result = launch.launch(_worker, (c,), c.world, env=launch.BENCH_ENV)[0][0]
        lines += [
            f"\n**{title}**, {c.world} ranks\n",
            "| budget | configuration | peak predicted / measured (MiB) | "
            "step predicted / measured (ms) | fits | vs fastest fitting hand |",
            "|---|---|---|---|---|---|",
        ]
        for row in result["rows"]:
            budget = row["bytes"]
            fitting = {n: m for n, m in result["hands"].items() if m[1] <= budget}
            fastest = min(fitting.items(), key=lambda kv: kv[1][0]) if fitting else None
            for name, cand, pred, (sec, peak, *_) in [
                ("plan: " + row["plan"].describe(), row["plan"], row["predicted"], row["measured"]),
                *[(n, None, result["predicted_hands"][n], m) for n, m in result["hands"].items()],
            ]:
                ratio = f"{sec / fastest[1][0]:.2f}x ({fastest[0]})" if fastest else "no hand config fits"
                lines.append(
                    f"| {row['budget']} {budget / mib:,.1f} | {name} | "
                    f"{pred.peak.total / mib:,.1f} / {peak / mib:,.1f} | "
                    f"{1e3 * pred.step.seconds:,.1f} / {1e3 * sec:,.1f} | {'yes' if peak <= budget else 'NO'} | "
                    f"{ratio if cand is not None else ''} |"
                )
    return lines
