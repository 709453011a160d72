"""``plan``: the FSDP configuration with the least predicted step time under a memory budget.

The candidates, per outermost unit in forward order (``n`` of them besides the root):

- sharding: NO_SHARD (replicated; gradients all-reduced), or FULL_SHARD with the last ``m``
  units (the first to run backward, where keeping them gathered saves the most waiting) kept
  gathered after forward, i.e. SHARD_GRAD_OP for them; ``m = n`` is SHARD_GRAD_OP throughout;
- activation checkpointing of the first ``k`` units (identical blocks save and cost the same
  whichever ``k`` are chosen);
- forward prefetch on or off (time only: the prefetched unit is in the memory estimate anyway);
- for FULL_SHARD, which modules are units: each block its own, or ``g`` consecutive blocks
  sharded together (``fully_shard`` of a list: one all-gather and one reduce-scatter for them,
  fewer and larger collectives, more gathered at once), ``g`` in 1, 2, 4 and all of them;
- on CUDA (nccl), each FULL_SHARD candidate also with CPU offload: shards, gradients and the
  optimizer step on the host, uploads and downloads around every gather and reduce-scatter.

Memory comes from :func:`fullshard.plan.peak.replayed_peak`, the model ``fullshard estimate``
uses and the estimator sweeps measure: one meta-device trace per ``k``, and per candidate the
engine's buffers replayed over it (its units, the units kept gathered, forward prefetch). On
NCCL and under CPU offload the replay is not the engine's: each such prediction is the larger of
the replay as on gloo and the additive model, and says so (the plan's output prints it). A
candidate fits when its predicted peak plus its margin does (the estimator's worst measured
under-estimate: :data:`~fullshard.plan.margin.MARGIN` for candidates with FULL_SHARD units,
:data:`~fullshard.plan.margin.MARGIN_KEPT` for NO_SHARD and SHARD_GRAD_OP throughout, the
strategies that were never under-estimated) with what calibration could not free. Time comes from
:mod:`fullshard.plan.steptime` on one calibration. On a CPU device offload is no candidate:
the shards already live in host memory. The offload candidates' copies and host optimizer step
are calibrated on the GPU; no GPU has been lent to check their predictions against a run yet.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fullshard.plan.candidate import Candidate, candidates
from fullshard.plan.estimate import UnitEstimate, estimate_model_state
from fullshard.plan.margin import (
    CUDA_MARGIN,
    CUDA_MARGIN_FROM,
    CUDA_SLACK,
    MARGIN,
    MARGIN_FROM,
    MARGIN_KEPT,
    MARGIN_KEPT_FROM,
    margin_for,
    slack_for,
)
from fullshard.plan.peak import PeakEstimate, StepTrace, device_type, offloads, replayed_peak, trace_step
from fullshard.plan.simulate import StepTime
from fullshard.plan.steptime import Calibration, predict_step


@dataclasses.dataclass(frozen=True)
class Scored:
    """A candidate with its predicted peak (bytes per rank) and step time."""

    candidate: Candidate
    peak: PeakEstimate
    step: StepTime


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen candidate (``best``; None when nothing fits), the runners-up (fastest first),
    the budget (bytes per rank), the candidate that needs the least budget, every candidate
    scored, the margin kept free (a fraction of each prediction; None: by strategy and backend),
    the bytes calibration left behind (counted on top of every prediction) and the process
    group's backend ("gloo" or "nccl": which measured error the default margin follows)."""

    best: Scored | None
    runners_up: list[Scored]
    budget: int
    smallest: Scored
    scored: list[Scored]
    margin: float | None = None
    leftover: int = 0
    backend: str = "gloo"

    def margin_of(self, s: Scored) -> float:
        """The share of ``s``'s predicted peak kept free: the caller's ``margin``, or by default
        :func:`~fullshard.plan.margin.margin_for` the candidate's strategy and the backend."""
        return self.margin if self.margin is not None else margin_for(regathers(s.candidate), self.backend)

    @property
    def slack(self) -> int:
        """Bytes kept free beside the margin: by default :func:`~fullshard.plan.margin.slack_for`
        the backend (2 MiB on NCCL), none when the caller gives the margin."""
        return slack_for(self.backend) if self.margin is None else 0

    def needs(self, s: Scored) -> int:
        """The budget (bytes) candidate ``s`` needs: its predicted peak, the margin, the slack and
        the leftover."""
        return needs(s.peak.total, self.margin_of(s)) + self.slack + self.leftover

    def margin_line(self) -> str:
        """Where the margin comes from, in one line."""
        if self.margin is None and self.backend == "nccl" and CUDA_MARGIN >= max(MARGIN, MARGIN_KEPT):
            line = CUDA_MARGIN_FROM.describe(CUDA_SLACK)
        elif self.margin is None:
            line = (
                f"{MARGIN_FROM.describe()}; for candidates whose units all keep their parameters from "
                f"forward to backward (NO_SHARD, SHARD_GRAD_OP) {MARGIN_KEPT_FROM.describe()}"
            )
        else:
            line = f"margin {100 * self.margin:.1f}% (given by the caller)"
        return line + (f"; {self.leftover / 2**20:,.2f} MiB left by calibration" if self.leftover else "")

    def describe(self) -> list[str]:
        """Markdown lines: the plan (or why none), its peak by category and step time, runners-up."""
        mib = 2**20
        if self.best is None:
            s = self.smallest
            return [
                f"Nothing fits {self.budget / mib:,.1f} MiB per rank: the smallest configuration "
                f"({s.candidate.describe()}) needs {self.needs(s) / mib:,.1f} MiB (its "
                f"predicted peak {s.peak.total / mib:,.1f} MiB and {100 * self.margin_of(s):.2f}% for the estimate's "
                "error"
                + (f", {self.slack / mib:,.0f} MiB for the allocator's unsplit blocks" if self.slack else "")
                + "); raise the budget to that, add "
                "ranks (shards and optimizer state shrink with the world size) or use a smaller batch.",
                self.margin_line(),
            ]
        b = self.best
        p = b.peak
        lines = [
            f"Plan for {self.budget / mib:,.1f} MiB per rank: **{b.candidate.describe()}**",
            f"predicted peak {p.total / mib:,.1f} MiB (in {p.moment}): shards {p.shards / mib:,.1f}, "
            f"gradients {p.gradients / mib:,.1f}, optimizer {p.optimizer / mib:,.1f}, gathered "
            f"{p.gathered / mib:,.1f}, gradient buffer {p.gradient_buffer / mib:,.1f}, activations "
            f"{p.activations / mib:,.1f}" + (f"; on the host {p.host / mib:,.1f}" if p.host else ""),
            *([f"Not exact: {p.bound}."] if p.bound else []),
            self.margin_line(),
            f"predicted step {1e3 * b.step.seconds:,.1f} ms (compute {1e3 * b.step.compute:,.1f}, exposed "
            f"communication {1e3 * b.step.exposed_comm:,.1f}, the engine's own work {1e3 * b.step.engine:,.1f}, "
            f"optimizer {1e3 * b.step.optimizer:,.1f})",
            "",
            "| runner-up | peak (MiB) | step (ms) |",
            "|---|---|---|",
        ]
        lines += [
            f"| {s.candidate.describe()} | {s.peak.total / mib:,.1f} | {1e3 * s.step.seconds:,.1f} |"
            for s in self.runners_up
        ]
        return lines


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (KiB, MiB, GiB, TiB, KB, MB, GB; any case).

    Raises:
        ValueError: not a positive size, naming the accepted forms.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"{text!r} is not a size: give a positive number with KiB, MiB, GiB (or KB, MB, GB), e.g. 8GiB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def plan(
    cal: Calibration,
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    budget: int,
    *,
    param_dtype: torch.dtype | None = None,
    runners_up: int = 4,
    margin: float | None = None,
) -> Plan:
    """Choose the fastest predicted candidate whose predicted peak, ``margin`` more (a fraction:
    by default :func:`~fullshard.plan.margin.margin_for` the candidate's strategy, from the
    estimator's worst measured under-estimate), plus what calibration left behind
    (``cal.leftover_bytes``), fits ``budget`` bytes per rank; predicted steps within :data:`TIE`
    of each other are a tie, which the candidate with the least :func:`machinery` wins.

    ``cal`` comes from :func:`~fullshard.plan.steptime.calibrate` at the job's world size,
    batch and dtype; ``make_model``, ``example``, ``loss_fn`` and ``is_unit`` as for
    :func:`~fullshard.plan.peak.estimate_peak`.

    Raises:
        ValueError: ``budget`` is not positive.
    """
    if budget <= 0:
        raise ValueError(f"budget={budget}: give the memory per rank in bytes, e.g. 8 * 2**30")
    scored = _score_all(cal, make_model, example, loss_fn, is_unit, param_dtype)
    return choose(
        scored, budget, margin=margin, leftover=cal.leftover_bytes, runners_up=runners_up, backend=cal.comm.backend
    )


def choose(
    scored: list[Scored],
    budget: int,
    *,
    margin: float | None = None,
    leftover: int = 0,
    runners_up: int = 4,
    backend: str = "gloo",
) -> Plan:
    """The plan under ``budget`` (bytes per rank) from candidates already scored (``plan(...).scored``):
    the fastest whose predicted peak, ``margin`` more, plus ``leftover`` bytes, fits; among those
    predicted within :data:`TIE` of the fastest, the one with the least :func:`machinery`.
    ``backend``: the process group's, for the default margin (:func:`~fullshard.plan.margin.margin_for`).

    Raises:
        ValueError: ``budget`` is not positive, or nothing was scored.
    """
    if budget <= 0 or not scored:
        raise ValueError(f"budget={budget}, {len(scored)} candidates: give a positive budget and scored candidates")
    result = Plan(None, [], budget, scored[0], scored, margin, leftover, backend)
    result = dataclasses.replace(result, smallest=min(scored, key=lambda s: (result.needs(s), s.peak.total)))
    fitting = sorted((s for s in scored if result.needs(s) <= budget), key=lambda s: (s.step.seconds, s.peak.total))
    if fitting:  # within the step model's resolution of the fastest, the least machinery wins
        ties = [s for s in fitting if s.step.seconds <= fitting[0].step.seconds * (1 + TIE)]
        best = min(ties, key=lambda s: (*machinery(s.candidate), s.step.seconds, s.peak.total))
        fitting.remove(best)
        fitting.insert(0, best)
    return dataclasses.replace(result, best=fitting[0] if fitting else None, runners_up=fitting[1 : 1 + runners_up])


# Predicted steps this close (a fraction of the fastest fitting one) are a tie: on plan sweep seed
# 2718 (docs/plan_sweep_seed2718.md) candidates predicted 1-3% apart measured up to 7% the other
# way (SHARD_GRAD_OP as one unit against NO_SHARD per block, both with AC; the engine's time per
# unit and the collectives' overlap are modelled to a few percent), while the choices between
# candidates predicted more than 5% apart went the predicted way by CPU time (by wall time one,
# 2718#8's drawn budget, predicted 11% faster, measured 6% slower, waiting on collectives).
TIE = 0.05


def regathers(c: Candidate) -> bool:
    """Whether some unit of ``c`` gathers its parameters again in backward (FULL_SHARD units)."""
    return not c.no_shard and any(g[0] not in c.keep_gathered for g in c.groups)


def machinery(c: Candidate) -> tuple[int, int, int, int]:
    """How much a candidate adds to the plain model's step, for breaking ties between predicted
    steps (lower: less): CPU offload, then the units that gather again in backward (0 for
    NO_SHARD; SHARD_GRAD_OP units keep their parameters from forward), then the blocks recomputed,
    then the number of sharded units (each one an all-gather and a reduce-scatter)."""
    if c.no_shard:
        return (int(c.offload), 0, len(c.checkpoint), 0)
    regather = sum(g[0] not in c.keep_gathered for g in c.groups)
    return (int(c.offload), 1 + regather, len(c.checkpoint), c.n_units)


def needs(peak: int, margin: float = MARGIN) -> int:
    """The budget (bytes) a predicted ``peak`` (bytes) needs with ``margin`` kept free."""
    return math.ceil(peak * (1 + margin))


def _score_all(
    cal: Calibration,
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    param_dtype: torch.dtype | None,
) -> list[Scored]:
    """Every candidate with its predicted peak (one meta trace per AC count, the engine's
    buffers replayed over it per candidate) and step."""
    world, backend = cal.comm.world_size, cal.comm.backend
    names = [n for n in cal.blocks if n != "<root>"]
    offload = offloads(True, backend)
    state = _model_states(cal, make_model, is_unit, param_dtype, offload)
    # (AC count, buffers cast) -> the tagged model, its traced step: one per AC count serves every
    # sharding, but for NO_SHARD (the FSDP1 wrapper, buffers cast to param_dtype) where
    # fully_shard leaves a floating-point buffer in another dtype than param_dtype.
    traced: dict[tuple[int, bool], tuple[nn.Module, StepTrace]] = {}
    differs = _buffers_differ(make_model, param_dtype)
    scored = []
    for c in candidates(names, offload=offload):
        key = (len(c.checkpoint), c.no_shard and differs)
        if key not in traced:
            make = _tagged(make_model, c.checkpoint)
            with torch.device("meta"):
                plain = make()
            cast = c.no_shard or not differs
            trace = (make, example, loss_fn, param_dtype, _is_tagged, device_type(backend), is_unit)
            traced[key] = (plain, trace_step(*trace, cast_buffers=cast, engine_gradients=True))
        plain, step = traced[key]
        peak = _replayed(c, plain, is_unit, step, state[c.no_shard, c.offload], world, param_dtype, backend)
        step_time = predict_step(
            cal,
            make_model,
            is_unit,
            no_shard=c.no_shard,
            keep_gathered=c.keep_gathered,
            checkpoint=c.checkpoint,
            param_dtype=param_dtype,
            forward_prefetch=c.forward_prefetch,
            group=1 if c.no_shard else c.group,
            state=state[c.no_shard, c.offload],
            offload=c.offload,
        )
        scored.append(Scored(c, peak, step_time))
    return scored


def predict_peak(
    c: Candidate,
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    world_size: int,
    *,
    param_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    backend: str = "gloo",
) -> PeakEstimate:
    """Candidate ``c``'s predicted peak (bytes per rank), as :func:`plan` scores it: one meta
    trace of the model with ``c``'s activation checkpointing, the engine's buffers replayed over
    it (:func:`~fullshard.plan.peak.replayed_peak`). Arguments as :func:`plan`'s.

    Raises:
        ValueError: as :func:`~fullshard.plan.estimate.estimate_model_state`.
    """
    make = _tagged(make_model, c.checkpoint)
    with torch.device("meta"):
        plain = make()
    trace = (make, example, loss_fn, param_dtype, _is_tagged, device_type(backend), is_unit)
    step = trace_step(*trace, cast_buffers=c.no_shard, engine_gradients=True)
    state = estimate_model_state(
        plain,
        is_unit,
        world_size,
        sharding_strategy="no_shard" if c.no_shard else "full_shard",
        param_dtype=param_dtype,
        optimizer=optimizer,
        offload=offloads(c.offload, backend),
    )
    return _replayed(c, plain, is_unit, step, state, world_size, param_dtype, backend)


def _replayed(
    c: Candidate,
    plain: nn.Module,
    is_unit: Callable[[nn.Module], bool],
    step: StepTrace,
    state: list[UnitEstimate],
    world: int,
    param_dtype: torch.dtype | None,
    backend: str,
) -> PeakEstimate:
    """``c``'s peak: the engine's buffers replayed over ``step`` of ``plain`` (tagged for ``c``'s AC)."""
    return replayed_peak(
        plain,
        is_unit,
        step,
        state,
        world,
        sharding_strategy="no_shard" if c.no_shard else "full_shard",
        param_dtype=param_dtype,
        checkpoint=_is_tagged,
        keep_gathered=c.keep_gathered,
        groups=[g for g in c.groups if len(g) > 1],
        forward_prefetch=c.forward_prefetch,
        backend=backend,
        offload=c.offload,
    )


def _model_states(
    cal: Calibration,
    make_model: Callable[[], nn.Module],
    is_unit: Callable[[nn.Module], bool],
    param_dtype: torch.dtype | None,
    offload: bool,
) -> dict[tuple[bool, bool], list[UnitEstimate]]:
    """(NO_SHARD, offload) -> each unit's model-state bytes, for the candidates' settings."""
    with torch.device("meta"):
        plain = make_model()
    return {
        (ns, off): estimate_model_state(
            plain,
            is_unit,
            cal.comm.world_size,
            sharding_strategy="no_shard" if ns else "full_shard",
            param_dtype=param_dtype,
            optimizer=cal.optimizer,
            offload=off,
        )
        for ns, off in ((False, False), (True, False), *([(False, True)] if offload else []))
    }


def _buffers_differ(make_model: Callable[[], nn.Module], param_dtype: torch.dtype | None) -> bool:
    """Whether a floating-point buffer of the model is in another dtype than ``param_dtype``
    (the FSDP1 wrapper casts it, ``fully_shard`` does not)."""
    if param_dtype is None:
        return False
    with torch.device("meta"):
        plain = make_model()
    return any(b.is_floating_point() and b.dtype != param_dtype for b in plain.buffers())


def _tagged(make_model: Callable[[], nn.Module], names: tuple[str, ...]) -> Callable[[], nn.Module]:
    """``make_model`` with the modules named in ``names`` marked for activation checkpointing."""

    def make() -> nn.Module:
        model = make_model()
        for name in names:
            model.get_submodule(name)._fullshard_plan_checkpoint = True  # type: ignore[assignment]
        return model

    return make


def _is_tagged(module: nn.Module) -> bool:
    return bool(getattr(module, "_fullshard_plan_checkpoint", False))
