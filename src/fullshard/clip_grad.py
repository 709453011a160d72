"""Gradient clipping over sharded gradients: the norm of the whole model's gradient.

Each rank holds only its shards' gradients, so the p-norm is assembled from per-group partial
sums: ``sum |g|^p`` over a unit's shards is all-reduced over that unit's shard group, while
gradients every rank holds whole (NO_SHARD units, ignored modules, one-rank groups) count once,
locally. The inf-norm takes maxima the same way. Every rank must call it (it is collective).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from fullshard import _collectives as C


def _group_key(param: torch.Tensor) -> Any:
    """The shard group ``param`` is split over; None when every rank holds it whole."""
    owner = getattr(param, "_fullshard_param", None)
    return owner.shard_group if owner is not None else None


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients of ``parameters``, as if unsharded.

    Returns:
        a float32 scalar tensor, identical on every rank.

    Raises:
        ValueError: ``norm_type`` is not positive.
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    params = list(parameters)
    groups_seen = [g for g in (_group_key(q) for q in params) if g is not None]
    # Partial sums live where their group can reduce them (CUDA for NCCL, even when the
    # gradients are offloaded to CPU).
    device = C.reduction_device(groups_seen[0]) if groups_seen else torch.device("cpu")
    partial: dict[int, torch.Tensor] = {}
    groups: dict[int, Any] = {}
    whole = torch.zeros((), dtype=torch.float32, device=device)
    for q in params:
        group = _group_key(q)
        key = id(group) if group is not None else 0
        if group is not None and key not in partial:
            partial[key] = torch.zeros((), dtype=torch.float32, device=device)
            groups[key] = group
        if q.grad is None or q.grad.numel() == 0:
            continue
        g = q.grad.detach().to(device, torch.float32)
        term = g.abs().max() if math.isinf(p) else g.abs().pow(p).sum()
        if group is None:
            whole = torch.maximum(whole, term) if math.isinf(p) else whole + term
        else:
            partial[key] = torch.maximum(partial[key], term) if math.isinf(p) else partial[key] + term
    total = whole
    for key, value in partial.items():  # same order on every rank: first appearance
        if math.isinf(p):
            C.all_reduce_max(value, groups[key])
            total = torch.maximum(total, value)
        else:
            C.all_reduce(value, groups[key])
            total = total + value
    return total if math.isinf(p) else total.pow(1.0 / p)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``; return the norm.

    Like ``torch.nn.utils.clip_grad_norm_``, for fullshard's shards: the norm is the one the
    unsharded model's gradients would have (collective: call on every rank).

    Args:
        parameters: parameters (shards) whose ``.grad`` to clip.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm; ``float('inf')`` for the max-norm.

    Returns:
        the total norm before clipping (float32 scalar tensor).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = total_grad_norm(params, norm_type)
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    grads = [q.grad for q in params if q.grad is not None]
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total
