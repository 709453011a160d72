"""Predicted peak of live tensor bytes per rank in one training step, without allocating.

One forward and backward of the *unwrapped* model runs on the meta device under
:class:`~fullshard.jobs.plan.tracker.LiveTensorBytes`: its peak, less the full parameters and the
gradients already produced at that moment, is what activations, saved tensors and temporaries
take (activation checkpointing applied as the job applies it; under mixed precision the model is
traced in the compute dtype). The FSDP step's peak adds, per rank:

- model state (:func:`~fullshard.jobs.plan.estimate.estimate_model_state`): parameter shards and
  optimizer state in full, sharded gradients in the fraction the trace had produced at its peak;
- gathered full parameters: the root unit, the largest unit and the largest other unit (the one
  being prefetched), in the compute dtype; fullshard's CPU buffer pool keeps such buffers
  between units, so the set is counted whole (SHARD_GRAD_OP: every unit, none reshards after
  forward);
- when the peak falls in backward, one full flat gradient of the largest unit (the
  reduce-scatter's input).

The moment of the peak is reported as forward or backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from fullshard.jobs.plan.estimate import UnitEstimate, estimate_model_state
from fullshard.jobs.plan.tracker import LiveTensorBytes


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """Predicted bytes per rank (ints) by category, their sum and when the peak occurs."""

    shards: int
    gradients: int
    optimizer: int
    gathered: int
    gradient_buffer: int
    activations: int
    phase: str
    units: list[UnitEstimate]

    @property
    def total(self) -> int:
        return self.shards + self.gradients + self.optimizer + self.gathered + self.gradient_buffer + self.activations


def trace_activations(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    compute_dtype: torch.dtype | None = None,
    checkpoint: Callable[[nn.Module], bool] | None = None,
) -> tuple[int, float, str]:
    """(activation and temporary bytes at the unwrapped step's peak, the fraction of gradient
    bytes produced by then, "forward" or "backward"), traced on the meta device."""
    from fullshard.frontend.activation_checkpointing import apply_activation_checkpointing

    params: list[nn.Parameter] = []

    def label() -> tuple[int, int]:
        grads = sum(p.grad.nbytes for p in params if p.grad is not None)
        return grads, torch._C._current_graph_task_id()

    with LiveTensorBytes("meta", label=label) as live:
        with torch.device("meta"):
            model = make_model()
            if compute_dtype is not None:
                model.to(compute_dtype)
            if checkpoint is not None:
                apply_activation_checkpointing(model, check_fn=checkpoint)
            batch = example()
        params.extend(model.parameters())
        param_bytes = sum(p.nbytes for p in params)
        live.reset_peak()
        loss_fn(model, batch).backward()
    grads, task = live.peak_label
    total_grads = sum(p.nbytes for p in params if p.requires_grad) or 1
    phase = "backward" if task >= 0 else "forward"
    return live.peak - param_bytes - grads, grads / total_grads, phase


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
) -> PeakEstimate:
    """Predict rank 0's peak live tensor bytes in a steady training step (see module docstring).

    Args:
        make_model: builds the unwrapped model (called under the meta device).
        example: builds one rank's batch (called under the meta device).
        loss_fn: ``(model, batch) -> scalar loss`` as the training loop computes it.
        is_unit: the auto-wrap policy's choice of units.
        checkpoint: the modules whose activations are recomputed in backward, if any.

    Raises:
        ValueError: as :func:`~fullshard.jobs.plan.estimate.estimate_model_state`.
    """
    with torch.device("meta"):
        plain = make_model()
    units = estimate_model_state(
        plain, is_unit, world_size, sharding_strategy=sharding_strategy, param_dtype=param_dtype, optimizer=optimizer
    )
    traced = trace_activations(make_model, example, loss_fn, param_dtype, checkpoint)
    keep = [u.name for u in units] if sharding_strategy == "shard_grad_op" else []
    return combine(units, traced, world_size, keep_gathered=keep, no_shard=sharding_strategy == "no_shard")


def combine(
    units: list[UnitEstimate],
    traced: tuple[int, float, str],
    world_size: int,
    *,
    keep_gathered: Collection[str] = (),
    no_shard: bool = False,
) -> PeakEstimate:
    """The peak from its parts: ``units`` from :func:`estimate_model_state`, ``traced`` from
    :func:`trace_activations`; units named in ``keep_gathered`` do not reshard after forward
    (SHARD_GRAD_OP for them), ``no_shard`` replicates everything (nothing gathered, gradients
    all-reduced in place)."""
    activations, grad_fraction, phase = traced
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
    if phase == "backward" and world_size > 1 and not no_shard:
        grad_buffer = largest
    return PeakEstimate(
        shards=sum(u.shard_bytes for u in units),
        gradients=round(grad_fraction * sum(u.grad_bytes for u in units)),
        optimizer=sum(u.optim_bytes for u in units),
        gathered=0 if no_shard else gathered,
        gradient_buffer=grad_buffer,
        activations=activations,
        phase=phase,
        units=units,
    )
