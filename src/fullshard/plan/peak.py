"""Predicted peak of live tensor bytes per rank in one training step, without allocating.

One forward and backward of the *unwrapped* model runs on the meta device under
:class:`~fullshard.plan.tracker.LiveTensorBytes`: its peak, less the full parameters and the
gradients already produced at that moment, is what activations, saved tensors and temporaries
take (activation checkpointing applied as the job applies it; under mixed precision the model is
traced in the compute dtype).

:func:`estimate_peak`, and the planner for each candidate, keep every sample of that trace
(:func:`trace_step`) and replay the engine's buffers over it, moment by moment
(:func:`replayed_peak`, :func:`fullshard.plan.schedule.replay`): the peak is the largest sum,
at one moment, of the activations then, the model state, the gradients as they stand then,
and the gathered, packed, received and pooled buffers alive then, which depend on the unit
running and the phase. That is the engine on gloo (CPU), the model the estimator sweeps
measure. On NCCL and under CPU offload the engine's buffers differ and no GPU run has checked
a replay of them: there the estimate is the larger of the replay as on gloo and the older
additive model, :func:`combine`, and its ``bound`` says so (:data:`NOT_REPLAYED`).
:func:`combine` adds the following terms to the trace's peak, per rank:

- model state (:func:`~fullshard.plan.estimate.estimate_model_state`): parameter shards and
  optimizer state in full; gradient shards in full on gloo (CPU) at world sizes above 1, where
  each unit keeps its reduce-scatter output buffer between steps (``zero_grad`` drops only the
  views), otherwise in the fraction the trace had produced at its peak;
- gathered full parameters: the root unit, the largest unit and the largest other unit (the one
  being prefetched), in the compute dtype; fullshard's CPU buffer pool keeps such buffers
  between units, so the set is counted whole (SHARD_GRAD_OP: every unit, none reshards after
  forward);
- when the peak falls in backward, one full flat gradient of the largest unit (the
  reduce-scatter's input) and, on gloo above 2 ranks with two units or more, the receive buffer
  of the reduce-scatter in flight during the next unit's backward (the whole input; measured at
  the peak of a 4-unit GPT, absent from a 1-unit MNIST Net's; at 2 ranks the reduce-scatter
  receives straight into the gradient shards).

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
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.plan.estimate import UnitEstimate, estimate_model_state, group_units
from fullshard.plan.schedule import Peak, model_state, replay, unit_buffers
from fullshard.plan.step_trace import StepTrace, cast_floats, grouped, trace_step
from fullshard.plan.trace_peak import Trace, trace_activations, trace_activations_at, traces_of

__all__ = [
    "PeakEstimate",
    "StepTrace",
    "Trace",
    "cast_floats",
    "combine",
    "estimate_peak",
    "replayed_peak",
    "trace_activations",
    "trace_activations_at",
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


NO_SHARD_OFFLOAD = (
    "cpu_offload with sharding_strategy no_shard on nccl is not modeled: the estimator has no model of what "
    "NO_SHARD stages on the device under CPU offload; estimate NO_SHARD without cpu_offload (its state kept "
    "on the device), or a sharded strategy with it"
)
"""The refusal of NO_SHARD with CPU offload on CUDA (the engine and torch's FSDP1 accept it)."""


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
    front_end: str = "wrapper",
    full_precision: tuple[type[nn.Module], ...] | None = None,
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
        front_end: "wrapper" (FullyShardedDataParallel, which keeps its last unit of forward
            gathered under FULL_SHARD, and under mixed precision casts floating-point buffers
            to ``param_dtype``) or "fully_shard" (buffers keep their dtype, every unit casts its
            inputs).
        full_precision: the module classes the wrapper keeps in float32, each module of them a
            unit of its own (``MixedPrecision._module_classes_to_ignore``); None: the wrapper's
            default under mixed precision, BatchNorm (none for ``fully_shard``, or without
            ``param_dtype``). Every other module computes in ``param_dtype``.

    Raises:
        ValueError: as :func:`~fullshard.plan.estimate.estimate_model_state`, or
            ``cpu_offload`` with ``no_shard`` on "nccl" (:data:`NO_SHARD_OFFLOAD`; on gloo offload
            moves nothing, in the engine as here, so the estimate is NO_SHARD's), or a
            ``front_end`` other than the two.
    """
    if sharding_strategy == "no_shard" and offloads(cpu_offload, backend):
        raise ValueError(NO_SHARD_OFFLOAD)
    if front_end not in ("wrapper", "fully_shard"):
        raise ValueError(f"front_end={front_end!r}: use 'wrapper' (FullyShardedDataParallel) or 'fully_shard'")
    if full_precision is None:
        wrapper_mp = front_end == "wrapper" and param_dtype not in (None, torch.float32)
        full_precision = (compat.BatchNormBase,) if wrapper_mp else ()
    if full_precision:
        classes, select = full_precision, is_unit
        is_unit = lambda m: select(m) or isinstance(m, classes)  # noqa: E731  (units of their own)
    with torch.device("meta"):
        plain = make_model()
    offload = offloads(cpu_offload, backend)
    mp, strategy = param_dtype, sharding_strategy
    kept = [n for n, m in plain.named_modules() if n and full_precision and isinstance(m, full_precision)]
    kept = kept if param_dtype is not None else []
    units = estimate_model_state(
        plain, is_unit, world_size, sharding_strategy=strategy, param_dtype=mp, optimizer=optimizer, offload=offload,
        full_precision=kept,
    )  # fmt: skip
    cast = front_end == "wrapper"  # the wrapper casts buffers to buffer_dtype, fully_shard leaves them
    step = trace_step(
        make_model, example, loss_fn, mp, checkpoint, device_type(backend), is_unit,
        checkpoint_context=checkpoint_context, cast_buffers=cast, engine_gradients=True,
        full_precision=full_precision if param_dtype is not None else (),
    )  # fmt: skip
    keep = [u.name for u in units] if strategy == "shard_grad_op" else []
    return replayed_peak(
        plain, is_unit, step, units, world_size, sharding_strategy=strategy, param_dtype=mp, checkpoint=checkpoint,
        keep_gathered=keep, backend=backend, offload=cpu_offload, keep_last=front_end == "wrapper",
        full_precision=kept,
    )  # fmt: skip


NOT_REPLAYED = {
    "nccl": (
        "NCCL is not replayed: the buffers are replayed as on gloo (its reduce-scatter receive "
        "buffers, pooled buffers kept across steps and resident gradient shards hold at least what "
        "NCCL's collectives and CUDA's pool hold) or added at the trace's peak where that is larger; "
        "meant as an upper bound: on one H100 at world size 1 no drawn configuration measured more "
        "live bytes (docs/estimate_cuda_sweep.md); NCCL at two or more ranks never checked (the CUDA "
        "allocator's stream-ordered frees are not modelled)"
    ),
    "offload": (
        "CPU offload is not replayed: the device's buffers are replayed as on gloo with shards, "
        "gradient shards and optimizer state on the host and the largest shard and gradient shard "
        "staged on the device throughout, or added at the trace's peak where that is larger; "
        "meant as an upper bound: on one H100 at world size 1 no drawn configuration measured more "
        "live bytes on the device (docs/estimate_cuda_sweep.md)"
    ),
}
"""What :func:`replayed_peak` says (in :attr:`PeakEstimate.bound`) where it cannot replay the
engine as it runs: every setting but gloo without offload, the one the sweeps measure."""


def replayed_peak(
    plain: nn.Module,
    is_unit: Callable[[nn.Module], bool],
    step: StepTrace,
    units: list[UnitEstimate],
    world_size: int,
    *,
    sharding_strategy: str = "full_shard",
    param_dtype: torch.dtype | None = None,
    checkpoint: Callable[[nn.Module], bool] | None = None,
    keep_gathered: Collection[str] = (),
    groups: Sequence[Sequence[str]] = (),
    forward_prefetch: bool = False,
    backend: str = "gloo",
    offload: bool = False,
    keep_last: bool = False,
    full_precision: Collection[str] = (),
) -> PeakEstimate:
    """One configuration's peak: the engine's buffers replayed over ``step`` (see
    :mod:`fullshard.plan.schedule`), on gloo as the engine runs. On NCCL and under CPU offload
    it takes the larger of the replay as on gloo (offload: model state on the host, staging on
    the device) and :func:`combine`, and says so in ``bound`` (:data:`NOT_REPLAYED`).

    Args: ``plain``, the unwrapped model (meta device); ``step``, :func:`trace_step` of it
    (compute dtype, ``checkpoint`` applied); ``units``, its model state for these settings
    (:func:`~fullshard.plan.estimate.estimate_model_state`); ``keep_gathered``: FULL_SHARD
    blocks kept gathered after forward; ``groups``: units of several blocks (``fully_shard`` of
    a list); ``forward_prefetch``: each unit's pre-forward starts the next one's gather;
    ``keep_last``: the FullyShardedDataParallel wrapper's last unit of forward kept gathered
    (``fully_shard`` keeps none of its own accord); ``full_precision``: units gathered, run
    and reduced in their parameters' own dtype under mixed precision (the wrapper's BatchNorm
    units), as ``units`` were estimated.

    Raises:
        KeyError: a group or kept unit is not one of the model's units.
    """
    off = offloads(offload, backend)
    buffers = unit_buffers(
        plain, is_unit, world_size, sharding_strategy=sharding_strategy, param_dtype=param_dtype, groups=groups,
        offload=off, full_precision=full_precision,
    )  # fmt: skip
    head = {n: g[0] for g in groups for n in g}
    merged, state = group_units(units, groups), grouped(step, groups)
    staged = (max(u.shard_bytes for u in merged), max(u.grad_bytes for u in merged)) if off else (0, 0)
    assert [b.name for b in buffers] == state.units, (buffers, state.units)  # both in owned_params' order
    peak = replay(
        buffers,
        state.samples,
        state.grad_totals,
        state.param_bytes,
        world_size,
        sharding_strategy=sharding_strategy,
        state=sum(staged) if off else model_state(merged),
        recomputed={head.get(n, n) for n in recomputed_units(plain, is_unit, checkpoint)},
        kept={head.get(n, n) for n in keep_gathered},
        groups=groups,
        forward_prefetch=forward_prefetch,
        offload=off,
        keep_last=keep_last,
    )
    replayed = _as_estimate(peak, merged, staged, off, step.bound)
    if backend == "gloo" and not off:
        return replayed
    keep = [u.name for u in merged] if sharding_strategy == "shard_grad_op" else list(keep_gathered)
    return _bounded(replayed, step, merged, world_size, sharding_strategy == "no_shard", keep, backend, off)


def _bounded(
    replayed: PeakEstimate,
    step: StepTrace,
    units: list[UnitEstimate],
    world: int,
    no_shard: bool,
    keep: list[str],
    backend: str,
    off: bool,
) -> PeakEstimate:
    """Where the replay is not the engine's (NCCL, offload): the larger of ``replayed`` and
    :func:`combine` at the trace's peak, ``bound`` saying so."""
    (traced,) = traces_of(step, [grad_scale(world, no_shard, backend, off)]).values()
    added = combine(units, traced, world, keep_gathered=keep, no_shard=no_shard, backend=backend, offload=off)
    larger = max(replayed, added, key=lambda e: e.total)
    why = NOT_REPLAYED["offload" if off else "nccl"]
    return dataclasses.replace(larger, bound="; ".join(b for b in (step.bound, why) if b))


def _as_estimate(peak: Peak, units: list[UnitEstimate], staged: tuple[int, int], off: bool, bound: str) -> PeakEstimate:
    """The replay's ``peak`` by category; ``off``: model state on the host, ``staged`` (a shard
    uploaded, a gradient shard to download) on the device."""
    shards, grads, optim = (sum(getattr(u, f) for u in units) for f in ("shard_bytes", "grad_bytes", "optim_bytes"))
    return PeakEstimate(
        shards=0 if off else shards,
        gradients=peak.grads,
        optimizer=0 if off else optim,
        gathered=peak.gathered + staged[0],
        gradient_buffer=peak.grad_buffer + staged[1],
        activations=peak.activations,
        phase=peak.phase,
        units=units,
        unit=peak.unit,
        host=shards + grads + optim if off else 0,
        bound=bound,
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
    """The peak from its parts, added at the trace's peak (the older model, now a second opinion
    on NCCL and under offload, see the module docstring): ``units`` from :func:`estimate_model_state`, ``traced`` from
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
        if backend == "gloo" and world_size > 2 and sum(u.name != "<root>" for u in units) >= 2:
            # a reduce-scatter in flight (its all-to-all's receive buffer) while the next unit's
            # backward runs; with one unit it only overlaps the root's, after the peak. At 2
            # ranks it receives straight into the gradient shards: no receive buffer.
            grad_buffer += largest
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
