"""A meta-device trace of one training step, kept sample by sample.

:func:`trace_step` runs one forward and backward of the unwrapped model on the meta device
under :class:`~fullshard.plan.tracker.LiveTensorBytes` and records, at every allocation, the
bytes alive, the gradient bytes each FSDP unit's parameters have produced, the phase and the
unit running (:class:`~fullshard.plan.running_unit.RunningUnit`). :mod:`fullshard.plan.peak`
takes the peak of it, and :mod:`fullshard.plan.schedule` replays the engine's buffers over it.
For the replay, each unit's parameters reach its forward through one autograd node made in its
pre-forward, as the engine's full parameters do, so that their gradients land when the engine
gets them (``engine_gradients``, :func:`_route_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fullshard import compat
from fullshard.compat import tree_map
from fullshard.plan.estimate import owned_params
from fullshard.plan.meta_trace import traced
from fullshard.plan.running_unit import RunningUnit
from fullshard.plan.tracker import LiveTensorBytes


def cast_floats(batch: Any, dtype: torch.dtype | None) -> Any:
    """``batch`` with its floating-point tensors in ``dtype`` (None: as it is), as mixed precision
    casts the root's forward inputs; integer tensors (token ids, labels) are left alone."""
    if dtype is None:
        return batch
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


class StepTrace(NamedTuple):
    """A traced step, sample by sample (see :func:`trace_step`): per sample (bytes alive,
    gradient bytes produced per unit in ``units``' order, in backward?, unit running); each
    unit's gradient bytes once all are produced; the parameters' bytes; what was assumed."""

    samples: list[tuple[int, tuple[int, ...], bool, str]]
    units: list[str]
    grad_totals: list[int]
    param_bytes: int
    bound: str


def trace_step(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    compute_dtype: torch.dtype | None = None,
    checkpoint: Callable[[nn.Module], bool] | None = None,
    device_type: str = "cpu",
    is_unit: Callable[[nn.Module], bool] | None = None,
    *,
    checkpoint_context: Callable[[], Any] | None = None,
    cast_buffers: bool = True,
    engine_gradients: bool = False,
    full_precision: tuple[type[nn.Module], ...] = (),
) -> StepTrace:
    """One forward and backward of the unwrapped model on the meta device, sampled at every
    allocation and once after backward has returned (arguments as
    :func:`~fullshard.plan.peak.trace_activations`); gradients are attributed to the unit
    owning each parameter (:func:`~fullshard.plan.estimate.owned_params` of ``is_unit``; every
    parameter to the root without it).

    Under mixed precision (``compute_dtype``) the parameters are traced in that dtype, and the
    floating-point buffers too with ``cast_buffers`` (the FSDP1 wrapper's ``buffer_dtype``).
    Without it they keep their own dtype and each unit's floating-point inputs are cast to
    ``compute_dtype`` as it starts, as ``fully_shard`` with a ``MixedPrecisionPolicy`` runs:
    an fp32 buffer (a sinusoidal position table) stays fp32 and promotes what it is added to.

    ``full_precision``: module classes kept in float32 (:func:`kept_full_precision`).

    ``engine_gradients``: each unit's gradients land when the engine receives them (all at once,
    when autograd reaches the node that made its full parameters, :func:`_route_gradients`),
    as the replay needs; without it, each as autograd computes it, as in the unwrapped model.

    Raises:
        MetaValueRead: as :func:`trace_activations`.
    """
    from fullshard.frontend.activation_checkpointing import apply_activation_checkpointing, checkpoint_wrapper

    owners: list[list[nn.Parameter]] = []
    running: list[RunningUnit] = []
    samples: list[tuple[int, tuple[int, ...], bool, str]] = []
    recording: list[bool] = []

    def observe(current: int) -> None:
        if recording:
            grads = tuple(sum(p.grad.nbytes for p in ps if p.grad is not None) for ps in owners)
            unit = running[0].name if running else "<root>"
            samples.append((current, grads, compat.in_backward(), unit))

    with LiveTensorBytes("meta", observe=observe) as live:
        with torch.device("meta"):
            model = make_model()
            if compute_dtype is not None:
                _to_compute_dtype(model, compute_dtype, cast_buffers, None if cast_buffers else is_unit, full_precision)
            owned = owned_params(model, is_unit or (lambda m: False))
            names = [name or "<root>" for name in owned]
            owners.extend(owned.values())
            if engine_gradients:
                _route_gradients(model, is_unit, owned)
            if is_unit is not None:
                running.append(RunningUnit(model, is_unit))
            if checkpoint is not None:
                kwargs: dict[str, Any] = {} if checkpoint_context is None else {"context_fn": checkpoint_context}
                apply_activation_checkpointing(
                    model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, **kwargs), check_fn=checkpoint
                )
            # The caller's batch (``raw``) stays alive through the step beside its cast copy:
            # mixed precision casts the root's floating-point inputs, the caller still holds them.
            raw = example()
            batch = cast_floats(raw, compute_dtype)
        param_bytes = sum(p.nbytes for ps in owners for p in ps)
        _sample_each_gradient([p for ps in owners for p in ps if p.requires_grad], live)
        recording.append(True)
        live.measure()
        with traced(device_type) as assumed:
            loss_fn(model, batch).backward()
        recording.clear()  # the end of backward: what autograd freed after its last allocation
        grads = tuple(sum(p.grad.nbytes for p in ps if p.grad is not None) for ps in owners)
        samples.append((live.measure(), grads, True, "<root>"))
    totals = [sum(p.nbytes for p in ps if p.requires_grad) for ps in owners]
    return StepTrace(samples, names, totals, param_bytes, "; ".join(dict.fromkeys(assumed)))


def _to_compute_dtype(
    model: nn.Module,
    dtype: torch.dtype,
    cast_buffers: bool,
    is_unit: Callable[[nn.Module], bool] | None,
    full_precision: tuple[type[nn.Module], ...] = (),
) -> None:
    """``model``'s parameters (and buffers, with ``cast_buffers``) in ``dtype``; each ``is_unit``
    module's floating-point inputs cast to ``dtype`` before its forward; the modules of
    ``full_precision`` back in float32 (:func:`kept_full_precision`)."""
    kept = [] if cast_buffers else [(m, n, b) for m in model.modules() for n, b in compat.module_buffers(m).items()]
    model.to(dtype)
    for m, name, b in kept:
        compat.module_buffers(m)[name] = b
    for m in model.modules():
        if is_unit is not None and is_unit(m):
            m.register_forward_pre_hook(lambda _, args, kwargs: cast_floats((args, kwargs), dtype), with_kwargs=True)
    kept_full_precision(model, full_precision)


def kept_full_precision(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> None:
    """Put the submodules of ``model`` of ``classes`` back in float32 (parameters and
    floating-point buffers) and give them the FSDP1 wrapper's casts (inputs to float32, outputs
    back: :func:`fullshard.frontend.full_precision.register_casts`), as it runs the modules of
    its ``MixedPrecision._module_classes_to_ignore`` (BatchNorm by default), each a unit of its
    own under an auto-wrap policy (the caller's ``is_unit`` selects them too)."""
    from fullshard.frontend.full_precision import register_casts

    for m in model.modules():
        if m is not model and classes and isinstance(m, classes):
            m.float()
            register_casts(m)


class _UnitGradients(torch.autograd.Function):
    """A unit's trainable parameters as its forward sees them: views whose gradients reach
    the parameters together, when autograd runs this node, as the engine's
    ``SplitFull`` (made in the unit's pre-forward) receives them and packs them."""

    @staticmethod
    def forward(ctx: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.set_materialize_grads(False)  # an unused parameter gets no gradient, not zeros
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return grads


Slot = tuple[nn.Module, str, nn.Parameter]  # a module's attribute holding a parameter


def _route_gradients(
    model: nn.Module, is_unit: Callable[[nn.Module], bool] | None, owned: dict[str, list[nn.Parameter]]
) -> None:
    """Each unit's (the root's too) trainable parameters, while its forward runs, replaced by
    :class:`_UnitGradients` views made in its pre-forward, as the engine installs its full
    parameters. Their gradients then land when autograd reaches that node: after every node
    of higher sequence number that is ready (the rest of the unit's own backward, an RMSNorm's
    float32 input among what it still holds), not the moment the last of them is computed.
    ``owned``: :func:`~fullshard.plan.estimate.owned_params`' of ``is_unit``."""
    heads = {"": model} | {n: m for n, m in model.named_modules() if n and is_unit is not None and is_unit(m)}
    owner = {id(p): name for name, ps in owned.items() for p in ps if p.requires_grad}
    slots: dict[str, list[Slot]] = {name: [] for name in heads}
    for m in model.modules():
        for attr, p in compat.module_parameters(m).items():
            if p is not None and id(p) in owner:
                slots[owner[id(p)]].append((m, attr, p))
    for name, head in heads.items():
        if slots[name]:
            head.register_forward_pre_hook(lambda _, args, s=slots[name]: _install_views(s))
            head.register_forward_hook(lambda _, args, out, s=slots[name]: _uninstall_views(s))


def _install_views(slots: list[Slot]) -> None:
    if not torch.is_grad_enabled():
        return
    params = list({id(p): p for _, _, p in slots}.values())
    views = dict(zip(map(id, params), _UnitGradients.apply(*params)))
    for m, attr, p in slots:
        compat.module_parameters(m)[attr] = views[id(p)]


def _uninstall_views(slots: list[Slot]) -> None:
    for m, attr, p in slots:
        compat.module_parameters(m)[attr] = p


def _sample_each_gradient(params: list[nn.Parameter], live: LiveTensorBytes) -> None:
    """A sample once each of ``params``' gradients has landed: the node that made it has freed
    its saved tensors by then, as when FSDP packs a unit's gradients after its last one."""
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: _discard(live.measure()))


def _discard(_: Any) -> None:
    """A hook's result that must be None."""


def grouped(step: StepTrace, groups: Sequence[Sequence[str]]) -> StepTrace:
    """``step`` seen with each of ``groups`` (unit names, ``fully_shard`` of a list) as one unit
    named after its first member: its members' gradient bytes summed, in every sample and in
    the totals. The samples still name the block running (the replay maps them to units).

    Raises:
        KeyError: a group names a unit the trace does not have.
    """
    head = {n: g[0] for g in groups for n in g}
    missing = [n for n in head if n not in step.units]
    if missing:
        raise KeyError(f"groups name {missing} that are not units ({', '.join(step.units)})")
    units = list(dict.fromkeys(head.get(n, n) for n in step.units))
    where = [units.index(head.get(n, n)) for n in step.units]

    def merge(per_unit: Sequence[int]) -> tuple[int, ...]:
        out = [0] * len(units)
        for j, v in zip(where, per_unit):
            out[j] += v
        return tuple(out)

    samples = [(alive, merge(grads), back, name) for alive, grads, back, name in step.samples]
    return StepTrace(samples, units, list(merge(step.grad_totals)), step.param_bytes, step.bound)
