"""The engine's own time per unit and step, beyond compute and collectives, measured.

The step-time model charges a unit its blocks' calibrated compute and its collectives' fitted
costs (:mod:`fullshard.plan.simulate`). The engine's own work is in neither: its hooks, the
views and copies between parameters and flat buffers, state changes, a collective's issue and
wait. Measured on this project's 2-core machine it was about 1 ms of CPU time per unit and step
at one rank (no collective at all), as much as a small collective costs: a model without it
ranks configurations with more units (FULL_SHARD per block against one unit of all blocks,
NO_SHARD against SHARD_GRAD_OP) as faster than they run.

:func:`calibrate_overhead` measures it per kind of unit the planner chooses between
(:class:`Overhead`: NO_SHARD through the FSDP1 wrapper, FULL_SHARD and SHARD_GRAD_OP through
``fully_shard``) on a stand-in for the model: as many units as the model has (up to
:data:`MOST_UNITS`), each with as many parameters as the model's units have (the median, up to
:data:`MOST_PARAMS`), a root with the root's, every parameter a small vector that the forward
adds to the activations (nothing to compute, every parameter with a gradient). Its step (forward,
backward, the optimizer) is timed unwrapped and wrapped each way, the four taking turns step by
step, in the process's CPU time on a CPU device (the engine's thread and gloo's: what other
processes on a shared machine do not change; its wall time per unit varied 2-40 ms between
minutes under other sessions' load), wall time on a GPU. A kind's overhead per unit is its step
less the unwrapped one less the CPU time of its collectives as the model has them
(``cpu_share`` of their seconds), over its units (the root counted), never below zero.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.plan.calibrate import BlockTime, CommModel, make_optimizer
from fullshard.plan.simulate import UnitCost, simulate_step

MOST_UNITS = 16  # the stand-in's units at most (time per unit is what is measured)
MOST_PARAMS = 32  # parameters per stand-in unit at most
WIDTH = 64  # elements of each stand-in parameter


@dataclasses.dataclass(frozen=True)
class Overhead:
    """Seconds of the engine's own work per unit and step (beyond compute and collectives), by
    the unit's kind: a NO_SHARD unit, a FULL_SHARD unit (resharded after forward) and a
    SHARD_GRAD_OP one (kept gathered). All 0: none measured (the model without it)."""

    no_shard: float = 0.0
    full_shard: float = 0.0
    shard_grad_op: float = 0.0

    def per_unit(self, no_shard: bool, reshard_after_forward: bool) -> float:
        """Seconds per step of one unit of this kind."""
        if no_shard:
            return self.no_shard
        return self.full_shard if reshard_after_forward else self.shard_grad_op


NONE = Overhead()


class _Cheap(nn.Module):
    """A stand-in unit: ``count`` parameters of :data:`WIDTH` elements, each added to the input."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.vectors = nn.ParameterList(nn.Parameter(torch.full((WIDTH,), 0.01)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for v in self.vectors:
            x = x + v
        return x


class _StandIn(nn.Module):
    """The stand-in model: a root with ``root_params`` parameters around ``units`` cheap units."""

    def __init__(self, units: int, params: int, root_params: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(_Cheap(params) for _ in range(units))
        self.head = _Cheap(max(1, root_params))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for u in self.units:
            x = u(x)
        return self.head(x).float().square().mean()


def calibrate_overhead(
    comm: CommModel,
    units: int,
    params_per_unit: int,
    root_params: int,
    device: torch.device,
    *,
    compute_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    group: Any = None,
    repeats: int = 15,
) -> Overhead:
    """Measure the engine's own seconds per unit and step of each kind (see the module note) on
    a stand-in of ``units`` units of ``params_per_unit`` parameters and a root of
    ``root_params``; collective: every rank of ``group`` (default: the world) calls it. Each
    time is the slowest rank's median of ``repeats`` steps after two warm-up steps; ``comm``
    (this machine's fitted collectives) gives the collectives' CPU time to subtract (on a GPU,
    their seconds). One rank measures nothing (NO_SHARD and one rank are the same).

    Raises:
        ValueError: ``units`` or ``params_per_unit`` below 0, or ``repeats`` below 1.
    """
    if units < 0 or params_per_unit < 0 or repeats < 1:
        raise ValueError(
            f"units={units}, params_per_unit={params_per_unit}, repeats={repeats}: give 0 or more, repeats 1 or more"
        )
    group = group if group is not None else collectives.default_group()
    if collectives.group_size(group) == 1:
        return NONE
    from fullshard.plan.candidate import Candidate

    n, p = min(units, MOST_UNITS), max(1, min(params_per_unit, MOST_PARAMS))
    names = tuple(f"units.{i}" for i in range(n))
    wrappings: dict[str, Candidate | None] = {
        "plain": None,
        "no_shard": Candidate(True, (), (), False, names),
        "full_shard": Candidate(False, (), (), False, names),
        "shard_grad_op": Candidate(False, names, (), False, names),
    }
    steps = _time_steps(wrappings, lambda: _StandIn(n, p, root_params), device, compute_dtype, optimizer, repeats)
    gc.collect()  # the wrapped stand-ins' hooks hold them in reference cycles: free their tensors now
    slowest = torch.tensor(steps, dtype=torch.float64, device=collectives.reduction_device(group))
    collectives.all_reduce_max(slowest, group)
    plain, *wrapped = slowest.tolist()
    per_kind = {}
    for (kind, cand), seconds in zip(list(wrappings.items())[1:], wrapped):
        assert cand is not None
        busy = _collectives(comm, n, p, root_params, cand.no_shard, cand.keep_gathered, compute_dtype)
        modelled = busy * (comm.cpu_share if device.type == "cpu" else 1.0)
        per_kind[kind] = max(0.0, (seconds - plain - modelled) / (n + 1))
    return Overhead(**per_kind)


def _time_steps(
    wrappings: dict[str, Any],
    make: Callable[[], nn.Module],
    device: torch.device,
    dtype: torch.dtype | None,
    optimizer: str,
    repeats: int,
) -> list[float]:
    """Median seconds of a training step of ``make()`` under each wrapping (None: unwrapped),
    the models taking turns step by step: process CPU seconds on a CPU device, else wall."""
    built = []
    for cand in wrappings.values():
        with torch.device(device):
            model = make()
            model = cand.apply(model, dtype) if cand is not None else model.to(dtype or torch.float32)
        built.append((model, make_optimizer(optimizer, model.parameters())))
    x = torch.ones(4, WIDTH, device=device, dtype=dtype or torch.float32)
    times: list[list[float]] = [[] for _ in built]
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    for i in range(repeats + 2):  # two warm-ups: lazy initialization, first allocations
        for (model, opt), kept in zip(built, times):
            _sync(device)
            start = clock()
            model(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= 2:
                kept.append(clock() - start)
    return [statistics.median(t) for t in times]


def _collectives(
    comm: CommModel,
    units: int,
    params: int,
    root_params: int,
    no_shard: bool,
    keep_gathered: tuple[str, ...],
    dtype: torch.dtype | None,
) -> float:
    """The model's seconds of the stand-in's collectives, one after another (``communication``)."""
    size = (dtype or torch.float32).itemsize  # gathers and reductions in the compute dtype

    def cost(name: str, count: int) -> UnitCost:
        nbytes = count * WIDTH * size  # WIDTH rows divide among the ranks: no padding
        gathered = 0 if no_shard else nbytes
        return UnitCost(name, BlockTime(0.0, 0.0), gathered, nbytes, reshard_after_forward=name not in keep_gathered)

    root = cost("<root>", max(1, root_params))
    rest = [cost(f"units.{i}", params) for i in range(units)]
    return simulate_step(root, rest, comm, no_shard=no_shard).communication


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
