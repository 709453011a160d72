"""Gradient clipping over sharded gradients: the norm of the whole model's gradient.

Each rank holds only its shards' gradients, so the p-norm is assembled from per-group partial
sums: ``sum |g|^p`` over a unit's shards is all-reduced over that unit's shard group, while
gradients every rank holds whole (NO_SHARD units, ignored modules, one-rank groups) count once,
locally. The inf-norm takes maxima the same way. Every rank must call it (it is collective).

The partial sums are accumulated in float64: the norm then rounds to the same float32 whether a
gradient is split over 1, 2 or 4 ranks, so a job's clipping, and with it its training, does not
depend on the world size (an elastic job that changes world size keeps its loss curve).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from fullshard import compat
from fullshard.comm import collectives, flight_recorder
from fullshard.engine.dynamo_guard import outside_dynamo
from fullshard.engine.sharded_param import local_tensor


def _group_key(param: torch.Tensor) -> Any:
    """The shard group ``param`` is split over; None when every rank holds it whole.

    Raises:
        NotImplementedError: a tensor-parallel parameter (also split over tp, which the partial
            sums here do not reduce over).
    """
    owner = getattr(param, "_fullshard_param", None)
    if owner is not None and owner.tp_spec is not None:
        raise NotImplementedError(
            f"fullshard.clip_grad_norm_: parameter {owner.fqn!r} is tensor-parallel (a DTensor on "
            f"{param.device_mesh if hasattr(param, 'device_mesh') else 'a (dp, tp) mesh'}), and fullshard's "
            "clip sums over shard groups only: clip with torch.nn.utils.clip_grad_norm_(model.parameters(), "
            "max_norm), which reduces over every mesh dimension"
        )
    return owner.shard_group if owner is not None else None


def total_grad_norm(parameters: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients of ``parameters``, as if unsharded.

    Returns:
        a float32 scalar tensor, identical on every rank.

    Raises:
        ValueError: ``norm_type`` is not positive.
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    inf = math.isinf(p)
    groups: dict[int, Any] = {}  # shard groups in order of first appearance: the same on every rank
    buckets: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for q in params_list(parameters):
        group = _group_key(q)
        key = id(group) if group is not None else 0
        if group is not None:
            groups.setdefault(key, group)
        grad = None if q.grad is None else local_tensor(q.grad)
        if grad is not None and grad.numel() > 0:
            buckets.setdefault((key, grad.device, grad.dtype), []).append(grad.detach())
    # Partial sums live where their group can reduce them (CUDA for NCCL, even when the gradients
    # are offloaded to CPU); without sharded groups, where the gradients are.
    if groups:
        device = collectives.reduction_device(next(iter(groups.values())))
    else:
        device = next((d for (_, d, _) in buckets), torch.device("cpu"))
    partial = {key: torch.zeros((), dtype=torch.float64, device=device) for key in [0, *groups]}
    for (key, _, _), grads in buckets.items():
        # One multi-tensor kernel per bucket: the p-norm of each gradient, in float64.
        norms = torch.stack(compat.foreach_norm(grads, p, dtype=torch.float64)).to(device)
        term = norms.max() if inf else norms.pow(p).sum()
        partial[key] = torch.maximum(partial[key], term) if inf else partial[key] + term
    total = partial.pop(0)
    for key, value in partial.items():
        with flight_recorder.at(phase="clip"):
            if inf:
                collectives.all_reduce_max(value, groups[key])
                total = torch.maximum(total, value)
            else:
                collectives.all_reduce(value, groups[key])
                total = total + value
    return (total if inf else total.pow(1.0 / p)).to(torch.float32)


def params_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters`` as a list (one tensor becomes a list of one)."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


@outside_dynamo
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``; return the norm.

    Like ``torch.nn.utils.clip_grad_norm_``, for fullshard's shards: the norm is the one the
    unsharded model's gradients would have (collective: call on every rank).

    Args:
        parameters: parameters (shards) whose ``.grad`` to clip.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm; ``float('inf')`` for the max-norm.
        error_if_nonfinite: raise if the total norm is nan or inf (every rank raises: the norm
            is the same on all), instead of scaling by it.
        foreach: False scales gradient by gradient; None or True use the batched kernels.

    Returns:
        the total norm before clipping (float32 scalar tensor).

    Under ``torch.compile`` (a compiled training step that clips) it runs eagerly, as fullshard's
    hooks do: its all-reduces go through fullshard's collectives, which record each one (clock,
    sequence number) for the watchdog, and none of that belongs in a graph.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the total norm is nan or inf; no gradient is
            changed.
    """
    params = params_list(parameters)
    total = total_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {total.item()}, so they "
            "cannot be clipped; pass error_if_nonfinite=False to scale them by it anyway"
        )
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for q in params:
        if q.grad is not None:
            grad = local_tensor(q.grad)
            buckets.setdefault((grad.device, grad.dtype), []).append(grad.detach())
    for (device, dtype), grads in buckets.items():
        if foreach is False:
            for grad in grads:
                grad.mul_(coef.to(device, dtype))
        else:
            compat.foreach_mul_(grads, coef.to(device, dtype))
    return total
