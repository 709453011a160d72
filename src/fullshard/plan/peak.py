"""Predicted peak of live tensor bytes per rank in one training step, without allocating.

One forward and backward of the *unwrapped* model runs on the meta device under
:class:`~fullshard.plan.tracker.LiveTensorBytes`: its peak, less the full parameters and the
gradients already produced at that moment, is what activations, saved tensors and temporaries
take (activation checkpointing applied as the job applies it; under mixed precision the model is
traced in the compute dtype).

On gloo (CPU) without offload, :func:`estimate_peak` keeps every sample of that trace
(:func:`trace_step`) and replays the engine's buffers over it, moment by moment
(:func:`fullshard.plan.schedule.replay`): the peak is the largest sum, at one moment, of the
activations then, the model state, the gradients as they stand then, and the gathered,
packed, received and pooled buffers alive then, which depend on the unit running and the phase.
Elsewhere (NCCL, CPU offload, and the planner's many candidates) :func:`combine` adds the
following terms to the trace's peak, per rank:

- model state (:func:`~fullshard.plan.estimate.estimate_model_state`): parameter shards and
  optimizer state in full; gradient shards in full on gloo (CPU) at world sizes above 1, where
  each unit keeps its reduce-scatter output buffer between steps (``zero_grad`` drops only the
  views), otherwise in the fraction the trace had produced at its peak;
- gathered full parameters: the root unit, the largest unit and the largest other unit (the one
  being prefetched), in the compute dtype; fullshard's CPU buffer pool keeps such buffers
  between units, so the set is counted whole (SHARD_GRAD_OP: every unit, none reshards after
  forward);
- when the peak falls in backward, one full flat gradient of the largest unit (the
  reduce-scatter's input) and, on gloo with two units or more, the receive buffer of the
  reduce-scatter in flight during the next unit's backward (one shard at 2 ranks, the whole
  input beyond; measured at the peak of a 4-unit GPT, absent from a 1-unit MNIST Net's).

Since a rank holds gradient shards rather than full gradients, its peak is not the unwrapped
model's: the trace takes the peak of activations plus the gradients as this rank holds them
(none extra when they are resident, ``1 / world`` of them otherwise, all under NO_SHARD). The
moment of the peak is reported as the phase (forward or backward) and the unit running then
(``<root>`` for the root's own layers: embeddings, head, loss).

Under CPU offload on CUDA (nccl) the shards, their gradients and the optimizer state live in
pinned host memory (:attr:`PeakEstimate.host`, not in the device's peak); the device holds
a unit's shard uploaded for its gather and its gradient shard before it is downloaded (the
largest shard, root included, each way, in the parameter dtype), and even one rank gathers a
full copy. On a CPU device offload changes nothing, as in the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import torch
from torch import nn

from fullshard.plan.estimate import UnitEstimate, estimate_model_state
from fullshard.plan.schedule import model_state, replay, unit_buffers
from fullshard.plan.step_trace import StepTrace, cast_floats, trace_step

__all__ = [
    "PeakEstimate",
    "StepTrace",
    "Trace",
    "cast_floats",
    "combine",
    "estimate_peak",
    "trace_activations",
    "trace_step",
]


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """Predicted bytes per rank (ints) by category, their sum and when the peak occurs: in
    ``phase`` ("forward" or "backward") while unit ``unit`` runs ("<root>": the root's own layers).
    ``bound`` is empty when the trace knew every shape; otherwise it names what the trace had to
    assume (e.g. a mixture-of-experts layer's routing), chosen so that the traced activations are
    an upper bound of any real step's; the other terms are as exact as they are elsewhere."""

    shards: int
    gradients: int
    optimizer: int
    gathered: int
    gradient_buffer: int
    activations: int
    phase: str
    units: list[UnitEstimate]
    unit: str = "<root>"
    host: int = 0  # CPU offload: shards, gradients and optimizer state in host memory (not in ``total``)
    bound: str = ""  # "": the trace knew every shape; else what it assumed (its activations: an upper bound)

    @property
    def moment(self) -> str:
        """When the peak occurs, e.g. "backward of blocks.3"."""
        return f"{self.phase} of {self.unit}"

    @property
    def total(self) -> int:
        return self.shards + self.gradients + self.optimizer + self.gathered + self.gradient_buffer + self.activations


class Trace(NamedTuple):
    """What :func:`trace_activations` finds at the step's peak: activation and temporary bytes,
    the fraction of gradient bytes produced by then, "forward" or "backward", the unit running,
    and what the trace assumed where it could not know ("": nothing)."""

    activations: int
    grad_fraction: float
    phase: str
    unit: str = "<root>"
    bound: str = ""


def trace_activations(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    compute_dtype: torch.dtype | None = None,
    checkpoint: Callable[[nn.Module], bool] | None = None,
    grad_scale: float = 1.0,
    device_type: str = "cpu",
    is_unit: Callable[[nn.Module], bool] | None = None,
    *,
    checkpoint_context: Callable[[], Any] | None = None,
) -> Trace:
    """What the step's peak holds besides parameters and gradients, traced on the meta device
    (see :class:`Trace`; the unit is one of ``is_unit``'s modules, or "<root>").

    The peak is taken of activations plus ``grad_scale`` x the gradients produced so far: the
    unwrapped model holds full gradients (``grad_scale`` 1), a rank of a sharded one its
    shards (``1 / world``), so its peak comes earlier in backward, where more activations live.
    ``device_type``: where the step will run ("cpu" or "cuda"); attention is traced as that
    device's kernel runs it (:func:`~fullshard.plan.meta_trace.traced`). ``checkpoint_context``:
    the ``context_fn`` the ``checkpoint`` modules are recomputed under (selective activation
    checkpointing, e.g. torch's ``create_selective_checkpoint_contexts``), traced as it runs.

    Raises:
        MetaValueRead: the model reads a tensor value, which the trace cannot give.
    """
    traces = trace_activations_at(
        make_model,
        example,
        loss_fn,
        (grad_scale,),
        compute_dtype,
        checkpoint,
        device_type,
        is_unit,
        checkpoint_context=checkpoint_context,
    )
    return traces[grad_scale]


def trace_activations_at(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    grad_scales: Collection[float],
    compute_dtype: torch.dtype | None = None,
    checkpoint: Callable[[nn.Module], bool] | None = None,
    device_type: str = "cpu",
    is_unit: Callable[[nn.Module], bool] | None = None,
    *,
    checkpoint_context: Callable[[], Any] | None = None,
) -> dict[float, Trace]:
    """:func:`trace_activations` at each of ``grad_scales`` from one traced step (the bytes
    alive and gradients produced at every allocation are kept, and each scale's peak taken
    from them): grad_scale -> Trace.

    Raises:
        MetaValueRead: as :func:`trace_activations`.
    """
    step = trace_step(
        make_model,
        example,
        loss_fn,
        compute_dtype,
        checkpoint,
        device_type,
        is_unit,
        checkpoint_context=checkpoint_context,
    )
    samples = [(alive, sum(grads), 0 if back else -1, unit) for alive, grads, back, unit in step.samples]
    total_grads = sum(step.grad_totals) or 1
    return {
        scale: _peak_of(samples, scale, step.param_bytes, total_grads)._replace(bound=step.bound)
        for scale in grad_scales
    }


def _peak_of(samples: list[tuple[int, int, int, str]], scale: float, param_bytes: int, total_grads: int) -> Trace:
    """The :class:`Trace` at the first sample with the most bytes alive, counting ``scale`` x
    the gradients produced by then."""
    best = max(range(len(samples)), key=lambda i: (samples[i][0] - round((1 - scale) * samples[i][1]), -i))
    alive, produced, task, unit = samples[best]
    peak = alive - round((1 - scale) * produced)
    phase = "backward" if task >= 0 else "forward"
    return Trace(peak - param_bytes - round(scale * produced), produced / total_grads, phase, unit)


def estimate_peak(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    world_size: int,
    *,
    param_dtype: torch.dtype | None = None,
    checkpoint: Callable[[nn.Module], bool] | None = None,
    optimizer: str = "adamw",
    sharding_strategy: str = "full_shard",
    backend: str = "gloo",
    cpu_offload: bool = False,
    checkpoint_context: Callable[[], Any] | None = None,
) -> PeakEstimate:
    """Predict rank 0's peak live tensor bytes in a steady training step (see module docstring).

    Args:
        make_model: builds the unwrapped model (called under the meta device).
        example: builds one rank's batch (called under the meta device).
        loss_fn: ``(model, batch) -> scalar loss`` as the training loop computes it.
        is_unit: the auto-wrap policy's choice of units.
        checkpoint: the modules whose activations are recomputed in backward, if any.
        checkpoint_context: their recomputation's ``context_fn`` (selective checkpointing), if any.
        backend: the process group's, "gloo" (CPU) or "nccl" (CUDA).
        cpu_offload: shards, gradients and optimizer state in host memory (CUDA only).

    Raises:
        ValueError: as :func:`~fullshard.plan.estimate.estimate_model_state`, or
            ``cpu_offload`` with ``no_shard``.
    """
    if cpu_offload and sharding_strategy == "no_shard":
        raise ValueError("cpu_offload=True needs a sharded strategy: use full_shard or shard_grad_op")
    with torch.device("meta"):
        plain = make_model()
    units = estimate_model_state(
        plain,
        is_unit,
        world_size,
        sharding_strategy=sharding_strategy,
        param_dtype=param_dtype,
        optimizer=optimizer,
        offload=offloads(cpu_offload, backend),
    )
    no_shard = sharding_strategy == "no_shard"
    where = device_type(backend)
    context = {"checkpoint_context": checkpoint_context}
    if backend == "gloo" and not cpu_offload:  # the engine's buffers replayed (fullshard.plan.schedule)
        step = trace_step(make_model, example, loss_fn, param_dtype, checkpoint, where, is_unit, **context)
        return _replayed(plain, is_unit, units, step, world_size, sharding_strategy, param_dtype, checkpoint)
    scale = grad_scale(world_size, no_shard, backend, cpu_offload)
    traced = trace_activations(make_model, example, loss_fn, param_dtype, checkpoint, scale, where, is_unit, **context)
    keep = [u.name for u in units] if sharding_strategy == "shard_grad_op" else []
    return combine(
        units, traced, world_size, keep_gathered=keep, no_shard=no_shard, backend=backend, offload=cpu_offload
    )


def _replayed(
    plain: nn.Module,
    is_unit: Callable[[nn.Module], bool],
    units: list[UnitEstimate],
    step: StepTrace,
    world_size: int,
    sharding_strategy: str,
    param_dtype: torch.dtype | None,
    checkpoint: Callable[[nn.Module], bool] | None,
) -> PeakEstimate:
    """:func:`estimate_peak` on gloo: the engine's buffers replayed over ``step``."""
    buffers = unit_buffers(plain, is_unit, world_size, sharding_strategy=sharding_strategy, param_dtype=param_dtype)
    by_name = {b.name: b for b in buffers}
    peak = replay(
        [by_name[n] for n in step.units],
        step.samples,
        step.grad_totals,
        step.param_bytes,
        world_size,
        sharding_strategy=sharding_strategy,
        state=model_state(units),
        recomputed=recomputed_units(plain, is_unit, checkpoint),
    )
    return PeakEstimate(
        shards=sum(u.shard_bytes for u in units),
        gradients=peak.grads,
        optimizer=sum(u.optim_bytes for u in units),
        gathered=peak.gathered,
        gradient_buffer=peak.grad_buffer,
        activations=peak.activations,
        phase=peak.phase,
        units=units,
        unit=peak.unit,
        bound=step.bound,
    )


def recomputed_units(
    model: nn.Module, is_unit: Callable[[nn.Module], bool], checkpoint: Callable[[nn.Module], bool] | None
) -> set[str]:
    """The units (names as :func:`~fullshard.plan.estimate.owned_params`'s) whose forward
    activation checkpointing runs again in backward: those ``checkpoint`` takes, or inside one."""
    if checkpoint is None:
        return set()
    wrapped = [name for name, m in model.named_modules() if checkpoint(m)]
    return {
        name
        for name, m in model.named_modules()
        if name and is_unit(m) and any(name == w or name.startswith(w + ".") or not w for w in wrapped)
    }


def device_type(backend: str) -> str:
    """The device a process group of ``backend`` steps on: "cuda" for nccl, else "cpu"."""
    return "cuda" if backend == "nccl" else "cpu"


def _resident_grads(world_size: int, no_shard: bool, backend: str) -> bool:
    """Whether gradient shards stay allocated between steps (fullshard's CPU reduce-scatter)."""
    return backend == "gloo" and world_size > 1 and not no_shard


def offloads(offload: bool, backend: str) -> bool:
    """Whether CPU offload moves anything off the device: only on CUDA (nccl)."""
    return offload and backend == "nccl"


def grad_scale(world_size: int, no_shard: bool, backend: str, offload: bool = False) -> float:
    """The share of the unwrapped model's gradient bytes that grows with backward on one rank:
    0 when gradient shards are resident (counted as model state instead) or offloaded to the
    host, else ``1 / world`` (1 under NO_SHARD)."""
    if _resident_grads(world_size, no_shard, backend) or offloads(offload, backend):
        return 0.0
    return 1.0 if no_shard else 1 / world_size


def combine(
    units: list[UnitEstimate],
    traced: Trace,
    world_size: int,
    *,
    keep_gathered: Collection[str] = (),
    no_shard: bool = False,
    backend: str = "gloo",
    offload: bool = False,
) -> PeakEstimate:
    """The peak from its parts, added at the trace's peak (NCCL, offload, the planner; gloo
    steps are replayed instead, see the module docstring): ``units`` from :func:`estimate_model_state`, ``traced`` from
    :func:`trace_activations` (with :func:`grad_scale` of the same settings); units named in
    ``keep_gathered`` do not reshard after forward (SHARD_GRAD_OP for them), ``no_shard``
    replicates everything (nothing gathered, gradients all-reduced in place), ``offload`` keeps
    model state in host memory (CUDA only; see the module docstring)."""
    activations, grad_fraction, phase, unit = traced.activations, traced.grad_fraction, traced.phase, traced.unit
    by_size = sorted(
        (u for u in units if u.name != "<root>" and u.name not in keep_gathered),
        key=lambda u: u.full_bytes,
        reverse=True,
    )
    root = next(u for u in units if u.name == "<root>")
    kept = sum(u.full_bytes for u in units if u.name in keep_gathered and u.name != "<root>")
    gathered = root.full_bytes + kept + sum(u.full_bytes for u in by_size[:2])
    grad_buffer = 0
    largest = max((u.full_bytes for u in units if u.name != "<root>"), default=0)
    offloaded = offloads(offload, backend)
    if phase == "backward" and (world_size > 1 or offloaded) and not no_shard:
        grad_buffer = largest
        if backend == "gloo" and sum(u.name != "<root>" for u in units) >= 2:
            # a reduce-scatter in flight (its all-to-all's receive buffer) while the next unit's
            # backward runs; with one unit it only overlaps the root's, after the peak
            grad_buffer += largest // world_size if world_size == 2 else largest
    resident = _resident_grads(world_size, no_shard, backend)
    shards, optimizer = sum(u.shard_bytes for u in units), sum(u.optim_bytes for u in units)
    gradients = round((1.0 if resident else grad_fraction) * sum(u.grad_bytes for u in units))
    host = 0
    if offloaded:  # model state on the host; the largest shard (root included) staged each way,
        # in the parameter dtype: uploaded before its cast, its gradient cast back before download
        host, shards, optimizer = shards + sum(u.grad_bytes for u in units) + optimizer, 0, 0
        gradients = 0
        gathered += max(u.shard_bytes for u in units)
        grad_buffer += max(u.grad_bytes for u in units) if phase == "backward" else 0
    return PeakEstimate(
        shards=shards,
        gradients=gradients,
        optimizer=optimizer,
        gathered=0 if no_shard else gathered,
        gradient_buffer=grad_buffer,
        activations=activations,
        phase=phase,
        units=units,
        unit=unit,
        host=host,
        bound=traced.bound,
    )
