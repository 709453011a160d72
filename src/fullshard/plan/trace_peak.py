"""The peak of a traced step's activations, with the gradients as one rank holds them.

:func:`trace_activations` takes the step's peak from :func:`~fullshard.plan.step_trace.trace_step`'s
samples: activations, saved tensors and temporaries at the moment where they, plus a share of
the gradients produced by then (``grad_scale``: 1 unwrapped, ``1 / world`` for a rank's shards),
are largest. :func:`fullshard.plan.peak.combine` adds the FSDP terms to it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import torch
from torch import nn

from fullshard.plan.step_trace import StepTrace, trace_step


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
    return traces_of(step, grad_scales)


def traces_of(step: StepTrace, grad_scales: Collection[float]) -> dict[float, Trace]:
    """:func:`trace_activations_at` of a step already traced: grad_scale -> Trace."""
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
