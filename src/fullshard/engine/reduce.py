"""The gradient side of an FSDP unit: pack, reduce-scatter, hand the shards their gradients.

Per-parameter gradients -> one packing copy, rank-major (N*S_t,), into pooled memory (the unit's
full parameters were freed just before, see ``Unit.reshard_for_packing``) -> cast to the reduce
dtype -> reduce-scatter -> (S_t,) -> cast back (and copied to CPU under offload) -> views of it
become the shards' ``.grad``. Low-precision reductions divide before and after the sum so float16
cannot overflow. The vocabulary (S, S_t, padded shard) is ``_unit``'s and ``_sharded_param``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fullshard.comm import buffers, collectives

if TYPE_CHECKING:
    from fullshard.engine.unit import Unit


def predivide_factor(ranks: int) -> int:
    """A power of two near sqrt(ranks) to divide gradients by before a low-precision sum."""
    factor = 1
    while ranks % (factor * 2) == 0 and ranks // (factor * 2) >= factor * 2:
        factor *= 2
    return factor


def pack_grads(unit: Unit, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The trainable parameters' full gradients packed rank-major, shape (N*S_t,).

    Row block r holds, parameter after parameter, the padded rows rank r owns: the layout
    of the reduce-scatter input, so the gradient is written once, in place for the
    collective. ``None`` (a parameter forward did not use) packs as zeros.
    """
    n = unit.world
    ref = next(g for g in grads if g is not None)
    parts = []
    for sp, g in zip(unit.trainable, grads):
        spec = sp.spec
        if g is None:
            parts.append(torch.zeros(n, spec.padded_shard_numel, dtype=ref.dtype, device=ref.device))
            continue
        rows = g.reshape(spec.rows, spec.row_numel)
        if spec.padded_numel != spec.numel:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, n * spec.chunk_rows - spec.rows))
        parts.append(rows.reshape(n, spec.padded_shard_numel))
    out = buffers.POOL.take(n * unit.grad_numel, ref.dtype, ref.device)
    torch.cat(parts, dim=1, out=out.view(n, unit.grad_numel))
    return out


def reduce_grads(unit: Unit) -> None:
    """Launch the reduce-scatter (and replica all-reduce) of the accumulated full gradient."""
    grad = unit.full_flat.grad
    if grad is None:
        return
    unit.full_flat.grad = None
    from fullshard.engine.unit import record  # the module tests swap EVENTS on

    record("reduce", unit)
    ranks = unit.world * unit.replicas
    low = unit.reduce_dtype in (torch.float16, torch.bfloat16)
    pre = predivide_factor(ranks) if low and unit.divide_factor is None else 1
    if grad.dtype != unit.reduce_dtype:
        grad = grad.to(unit.reduce_dtype)
    if pre > 1:
        grad.div_(pre)
    post = (unit.divide_factor or ranks) / pre
    all_reduce = unit.replicas > 1 and unit.all_reduce_grads
    if unit.world == 1:
        out = grad
    else:
        out = _reduce_output(unit, grad.dtype, grad.device)
    handles: list[collectives.Handle] = []
    if unit.world > 1:
        h = collectives.reduce_scatter(
            out, grad, unit.shard_group, divide_by=1.0 if unit.replicas > 1 else post, async_op=True
        )
        assert h is not None
        handles.append(h)
    if all_reduce:
        for h in handles:  # the all-reduce follows the reduce-scatter's local epilogue
            h.wait()
        if unit._partial_reduce is not None:  # reduce-scattered while the all-reduce was off
            out.add_(unit._partial_reduce)
            unit._partial_reduce = None
        h2 = collectives.all_reduce(out, unit.replicate_group, divide_by=post, async_op=True)
        assert h2 is not None
        handles.append(h2)
    elif unit.world == 1 and post != 1 and unit.replicas == 1:
        out.div_(post)
    partial = unit.replicas > 1 and not all_reduce
    unit._pending_reduce = (_Multi(handles), out, grad if unit.world > 1 else None, partial)


def _reduce_output(unit: Unit, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where the reduce-scatter writes this rank's gradient shard, shape (S_t,).

    On CPU, last step's buffer when nothing holds it any more (``zero_grad`` dropped the
    shards' ``.grad`` views): reused, it costs no fresh pages. Otherwise a new buffer.
    """
    last = unit._last_reduce_out
    if last is not None and last.dtype == dtype and last.device == device and buffers.sole_owner(last):
        return last
    out = torch.empty(unit.grad_numel, dtype=dtype, device=device)
    unit._last_reduce_out = out if device.type == "cpu" else None
    return out


def finish_reduce(unit: Unit) -> None:
    """Wait for the pending reduction and add the result to the shards' ``.grad``."""
    if unit._pending_reduce is None:
        return
    handle, out, sent, partial = unit._pending_reduce
    handle.wait()
    unit._pending_reduce = None
    if sent is not None:
        buffers.POOL.give(sent)  # the packed gradient: the next unit of this size packs into it
    if partial:  # set_requires_all_reduce(False): sums kept until an all-reduce takes them
        if unit._partial_reduce is None:
            unit._partial_reduce = out.clone()
        else:
            unit._partial_reduce.add_(out)
        return
    keep_low = unit.config.keep_low_precision_grads
    grad_dtype = out.dtype if keep_low else unit.dtype
    if out.dtype != grad_dtype or out.device != unit._shard_device:
        host = _grad_buffer(unit, out.shape, grad_dtype)
        host.copy_(out, non_blocking=host.is_pinned())
        out = host
    for sp in unit.trainable:
        assert sp.shard is not None
        g = unit._local_view(sp, out)
        current = sp.local_grad()
        if current is None:
            if g.dtype != sp.shard.dtype:  # keep_low_precision_grads: .data takes any dtype
                sp.shard.grad = torch.empty_strided(g.shape, (0,) * g.dim(), dtype=sp.shard.dtype, device=g.device)
                sp.shard.grad.data = g
            else:
                sp.set_grad(g)
        else:
            current.add_(g)


def _grad_buffer(unit: Unit, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Where cast or offloaded gradients land: reused while no shard still holds the last one.

    Pinned allocations are slow, so under offload the buffer is kept between steps; it is
    replaced when gradients are being accumulated (a shard's ``.grad`` may be a view of it).
    """
    cached = unit._host_grad
    if (
        cached is not None
        and cached.dtype == dtype
        and all(sp.shard is not None and sp.shard.grad is None for sp in unit.trainable)
    ):
        return cached
    pin = unit.config.offload and torch.cuda.is_available()
    buffer = torch.empty(shape, dtype=dtype, device=unit._shard_device, pin_memory=pin)
    if unit.config.offload:
        unit._host_grad = buffer
    return buffer


class _Multi:
    """Waits on several handles in order."""

    def __init__(self, handles: list[collectives.Handle]) -> None:
        self._handles = handles

    def wait(self) -> None:
        for h in self._handles:
            h.wait()
