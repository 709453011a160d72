"""A unit's custom collectives: torch FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``.

A *comm* is the user's object in torch's ``AllGather`` / ``ReduceScatter`` protocol: a method
``allocate(size, *, dtype, device)`` returning a tensor of ``size`` (always ``(numel,)`` here,
as torch asks), and a call ``comm(output_tensor=..., input_tensor=..., group=..., async_op=...)``
(all-gather) or ``comm(output_tensor=..., input_tensor=..., group=..., op=...)`` (reduce-scatter)
that returns None (done) or a Work to wait on. Set on a unit, it replaces fullshard's own
collective for that unit only (not for the units of its submodules), as torch's does. The
vocabulary (S, S_t, N, full flat buffer) is :mod:`.layout`'s.

- All-gather, at every unshard (forward, backward, ``unshard()`` by hand, prefetches): one call
  per unit. Its output, (N*S,) in the compute dtype on the compute device, comes from
  ``comm.allocate`` each time; this rank's shards are copied into its slice ``[r*S, (r+1)*S)``,
  which is the input (a view of the output, as in torch); when the comm is done the rank-major
  output is copied into the param-major full flat buffer (a parameter sharded along a dim > 0
  rearranged into its full tensor on the way) and dropped. Under
  ``reshard_after_forward=M`` backward's all-gather within the M-rank group goes through the
  comm too (output M x the kept part). fullshard's own gloo all-gather splits a unit at large
  parameters; a custom one is never split.
- Reduce-scatter, once per unit per synced backward: the packed gradient (N*S_t,) is copied (and
  cast to the reduce dtype) into an input from ``comm.allocate``, the output (S_t,) comes from
  ``comm.allocate`` too, and the shards' ``.grad`` become views of the output (cast copies under
  mixed precision or offload). The comm gets torch's reduction op (:func:`reduce_plan`) and
  must apply it, averaging included. A hybrid unit's replica all-reduce stays fullshard's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fullshard.comm import collectives, custom_collectives
from fullshard.engine.layout import UnitLayout


def check(unit: UnitLayout, comm: Any, setter: str) -> None:
    """Refuse a ``comm`` that ``unit`` cannot use (None, going back to fullshard's own, passes).

    Raises:
        TypeError: ``comm`` has no ``allocate`` or cannot be called.
        ValueError: the unit communicates quantized (``comm_quantization``) in that direction.
    """
    if comm is None:
        return
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{setter}: comm must follow torch's AllGather / ReduceScatter protocol (an allocate(size, *, dtype, "
            f"device) method and __call__), got {type(comm).__name__}"
        )
    quant = unit.config.comm_quantization
    wire = None if quant is None else (quant.params if setter == "set_custom_all_gather" else quant.grads)
    if wire is not None:
        field = "params" if setter == "set_custom_all_gather" else "grads"
        raise ValueError(
            f"{setter}: FSDP unit {unit.name!r} was sharded with comm_quantization={quant!r}, whose {field}={wire!r} "
            f"replaces that collective by a quantized one; a custom comm and quantization cannot both apply. "
            f"Shard the module with comm_quantization {field}=None to use a custom comm (or drop the custom comm)"
        )


def allocated(comm: Any, numel: int, dtype: torch.dtype, device: torch.device, setter: str) -> torch.Tensor:
    """``comm.allocate((numel,), dtype=dtype, device=device)``, checked, as a 1-D tensor.

    Raises:
        TypeError: the result is not a contiguous tensor of ``numel`` elements of ``dtype`` on ``device``.
    """
    t = comm.allocate((numel,), dtype=dtype, device=device)
    if (
        not isinstance(t, torch.Tensor)
        or t.numel() != numel
        or t.dtype != dtype
        or t.device.type != device.type
        or not t.is_contiguous()
    ):
        got = f"shape {tuple(t.shape)}, {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(
            f"{setter}: {type(comm).__name__}.allocate(({numel},), dtype={dtype}, device={device}) returned {got}; "
            f"it must return a contiguous tensor of {numel} elements of that dtype on that device"
        )
    return t.view(-1)


def gather(unit: UnitLayout, comm: Any, async_op: bool) -> collectives.Handle:
    """All-gather the unit's shards into its full flat buffer (memory already given) through
    ``comm``; the returned Handle's wait finishes the comm and copies out."""
    n, me, s = unit.shard_size, unit.rank, unit.shard_numel
    out = allocated(comm, n * s, unit.compute_dtype, unit.device, "set_custom_all_gather")
    rows = out.view(n, s)
    rows[me].copy_(unit.local_flat, non_blocking=True)  # cast and/or upload into our slice
    handle = custom_collectives.all_gather(comm, out, rows[me], unit.shard_group, async_op=async_op)
    full = unit.full_data

    def copy_out() -> None:
        sizes = [sp.spec.padded_shard_numel for sp in unit.params]
        targets = [full[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(n, -1) for sp in unit.params]
        # Parameters sharded along a dim > 0 (shard_placement_fn) rearranged on the way.
        unit.copy_out_ranked(rows, unit.params, sizes, targets, dims=bool(unit.dim_params))

    return collectives.Handle(handle, copy_out)


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """How a custom reduce-scatter's gradient is divided (torch FSDP2's rule, see :func:`reduce_plan`).

    Attributes:
        op: the op the comm gets: "avg", "sum" or "premul_sum" (multiply by ``scale``, sum).
        scale: ``premul_sum``'s factor.
        pre: fullshard divides the comm's input by this first.
        replica_divide: the replica all-reduce (hybrid sharding) divides its sum by this.
        post: fullshard divides the fully reduced gradient by this last.
    """

    op: str
    scale: float = 1.0
    pre: float = 1.0
    replica_divide: float = 1.0
    post: float = 1.0


def reduce_plan(unit: UnitLayout, force_sum: bool, predivide: Callable[[float], int]) -> ReducePlan:
    """torch FSDP2's choice of reduction for ``unit``'s gradient (restated, not its code).

    In float32 and bfloat16 the comm averages (``avg``; the replica all-reduce averages too), or,
    under ``set_gradient_divide_factor(f)``, reduces with ``premul_sum(1/f)`` (``avg`` when f is
    the shard group's size; the replica all-reduce then sums). A backend without PREMUL_SUM
    (gloo, where torch's own fails) gets ``sum`` and fullshard divides by f after. In other
    dtypes (float16), or with ``force_sum`` (``set_force_sum_reduction_for_comms(True)``), the
    comm sums, fullshard dividing by a power of two near sqrt(f) before (float16 only) and by the
    rest after, f being the data-parallel size when no factor is set.

    Args:
        unit: the unit (its dtypes, group sizes and ``divide_factor``).
        force_sum: only ``sum`` for the comm.
        predivide: the power of two to divide float16 gradients by before the sum, given f
            (:func:`fullshard.comm.collectives.predivide_factor`).
    """
    factor = unit.divide_factor
    safe_dtype = unit.reduce_dtype in (torch.float32, torch.bfloat16)  # no overflow to guard against
    if safe_dtype and not force_sum:
        if factor is None:
            return ReducePlan("avg", replica_divide=float(unit.replicate_size))
        if factor == unit.shard_size:
            return ReducePlan("avg")
        if custom_collectives.supports_premul_sum(unit.shard_group):
            return ReducePlan("premul_sum", scale=1.0 / factor)
        return ReducePlan("sum", post=factor)
    total = factor if factor is not None else float(unit.shard_size * unit.replicate_size)
    pre = 1.0 if safe_dtype else float(predivide(total))
    return ReducePlan("sum", pre=pre, post=total / pre)


def reduce_scatter(
    unit: UnitLayout, comm: Any, grad: torch.Tensor, plan: ReducePlan, post: float
) -> tuple[torch.Tensor, collectives.Handle]:
    """Start reduce-scattering the packed ``grad`` (N*S_t,) through ``comm`` as ``plan`` says.

    Returns:
        the output (S_t,) from ``comm.allocate`` in the reduce dtype, and the Handle whose wait
        finishes the comm and divides the output by ``post`` (1: not at all). ``grad`` is free
        to reuse on return (copied into the comm's input).
    """
    n, numel, dtype = unit.shard_size, unit.grad_numel, unit.reduce_dtype
    source = allocated(comm, n * numel, dtype, unit.device, "set_custom_reduce_scatter")
    source.copy_(grad)
    if plan.pre != 1.0:
        source.div_(plan.pre)
    out = allocated(comm, numel, dtype, unit.device, "set_custom_reduce_scatter")
    held = [source]  # the comm's input lives until its wait

    def epilogue() -> None:
        held.clear()
        if post != 1.0:
            out.div_(post)

    handle = custom_collectives.reduce_scatter(comm, out, source, unit.shard_group, plan.op, plan.scale, epilogue)
    return out, handle
