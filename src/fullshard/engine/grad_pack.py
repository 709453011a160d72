"""Packing a unit's per-parameter full gradients into the reduce-scatter's input.

The pack is rank-major, shape (N*S_t,): row block r holds, parameter after parameter, the
padded rows rank r owns (the vocabulary, S_t and padded shard, is :mod:`.layout`'s and
:mod:`.sharded_param`'s), so each gradient is written once, straight into the collective's
input, in pooled memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fullshard.comm import buffers
from fullshard.engine.layout import UnitLayout
from fullshard.engine.sharded_param import ShardSpec


def pack_grads(unit: UnitLayout, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The trainable parameters' full gradients packed rank-major, shape (N*S_t,).

    Row block r holds, parameter after parameter, the padded rows rank r owns: the layout
    of the reduce-scatter input, so the gradient is written once, in place for the
    collective, and a padded parameter's gradient is not padded in a copy of its own first.
    ``None`` (a parameter forward did not use) packs as zeros.
    """
    n = unit.shard_size
    ref = next(g for g in grads if g is not None)
    out = buffers.POOL.acquire(n * unit.grad_numel, ref.dtype, ref.device)
    pack_into(out.view(n, unit.grad_numel), grads, [sp.spec for sp in unit.trainable])
    return out


def pack_into(rows: torch.Tensor, grads: Sequence[torch.Tensor | None], specs: Sequence[ShardSpec]) -> None:
    """Pack parameters' full gradients side by side into a rank-major pack, one
    :func:`pack_rows_into` each.

    Args:
        rows: shape (N, sum of the specs' ``padded_shard_numel``), contiguous; row r becomes
            rank r's shard of the reduce-scatter input.
        grads: one full gradient per spec (shapes ``orig_shape``, any dtype: cast by the copy),
            None for zeros.
        specs: the parameters' sharding, in pack order.
    """
    n = rows.shape[0]
    if all(
        g is not None
        and g.dtype == rows.dtype
        and not g.requires_grad
        and spec.padded_numel == spec.numel
        and spec.dim == 0
        for spec, g in zip(specs, grads)
    ):
        # No padding and nothing missing: rank r's row of the pack is each gradient's r-th
        # chunk of rows, side by side, so one concatenation along dim 1 writes the whole pack
        # (the same bits as the per-parameter copies below, in one call instead of several each).
        # Not for gradients that require grad (``backward(create_graph=True)``): ``out=``
        # refuses them, where ``copy_`` into the pack records the copy.
        torch.cat([g.reshape(n, spec.padded_shard_numel) for spec, g in zip(specs, grads)], dim=1, out=rows)  # type: ignore[union-attr]
        return
    offset = 0
    for spec, g in zip(specs, grads):
        width = spec.padded_shard_numel
        pack_rows_into(rows[:, offset : offset + width], g, spec)
        offset += width


def pack_rows_into(dest: torch.Tensor, grad: torch.Tensor | None, spec: ShardSpec) -> None:
    """Copy one parameter's full gradient into its columns of a rank-major pack.

    Args:
        dest: shape (N, ``spec.padded_shard_numel``), a view whose rows may be strided: row r
            receives the ``spec.chunk_rows`` rows of ``grad`` that rank r owns (along the shard
            dim), zeros after the last real row (the padding).
        grad: shape ``spec.orig_shape`` (any layout and dtype: cast by the copy), or None for
            zeros.
        spec: the parameter's sharding (``rows``, ``row_numel``, ``chunk_rows``).
    """
    n, chunk = dest.shape[0], spec.chunk_rows
    if grad is None or chunk == 0:
        dest.zero_()
        return
    if spec.padded_shard_numel > spec.chunk_numel:  # a one-rank unit's alignment (see ShardSpec.align)
        dest[:, spec.chunk_numel :].zero_()
        dest = dest[:, : spec.chunk_numel]
    if spec.dim != 0:  # rows along another dim: each rank's shard contiguous in its own shape
        spec.full_to_ranked(grad, dest)
        return
    blocks = dest.view(n, chunk, spec.row_numel)
    rows = grad.reshape(spec.rows, spec.row_numel)
    whole, rest = divmod(spec.rows, chunk)
    blocks[:whole].copy_(rows[: whole * chunk].reshape(whole, chunk, spec.row_numel))
    if whole < n:
        blocks[whole, :rest].copy_(rows[whole * chunk :])
        blocks[whole, rest:].zero_()
        blocks[whole + 1 :].zero_()
