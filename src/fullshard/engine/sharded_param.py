"""Sharded parameter: how one original parameter is split across the ranks of a shard group.

Vocabulary (used throughout fullshard):

- **shard**: the rows of a parameter that one rank owns. A parameter of shape (d0, *rest) is
  split along dim 0 with ``torch.chunk`` semantics over the N ranks of the shard group: every
  rank gets ``chunk = ceil(d0 / N)`` rows except the last ranks, which may hold fewer rows or
  none. A 0-dim parameter is treated as shape (1,).
- **shard dim**: the dim a parameter is split along, 0 unless ``fully_shard``'s
  ``shard_placement_fn`` chose another (``Shard(d)``, d > 0). "Rows" are then the indices along
  dim d: the shard is ``full.narrow(d, start, rows)``, stored contiguous in its own shape (as
  torch's FSDP2 stores it), and the unit rearranges the gathered parameter and the packed
  gradient at the boundary (:meth:`ShardSpec.ranked_to_full`, :meth:`ShardSpec.full_to_ranked`).
- **padded shard size**: ``chunk * prod(rest)`` elements (rest: the other dims), the same on
  every rank; with one rank rounded up to 64 bytes (:func:`one_rank_align`), so that each
  parameter of a one-rank unit starts on a 64-byte line. Padding exists only inside the flat and
  communication buffers, never in the registered shard.
- **flat buffer**: one 1-D tensor holding several parameters back to back. A unit keeps a local
  flat buffer of padded shards (its all-gather input) and, while unsharded, a full flat buffer
  of padded full parameters (its all-gather output after the copy-out).

The registered ``nn.Parameter`` is the local shard of shape (rows, *rest) in the parameter's
original dtype, a view into the unit's local flat buffer: a plain tensor under the FSDP1 wrapper,
and under ``fully_shard`` a ``DTensor`` of the full shape (placement ``Shard(0)``, or
``(Replicate(), Shard(0))`` on a 2-D mesh; ``Shard(d)`` for shard dim d) whose local tensor is
that view, as torch's FSDP2 registers. The engine reads and writes only the local tensors
(:func:`local_tensor`). A tensor-parallel parameter (``tp_spec`` set) is sharded through its
TP-local tensor: ``orig_shape`` is that tensor's shape, and forward sees the gathered value as a
DTensor on the tp mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import torch
from torch import nn

from fullshard import compat

ALIGN_BYTES = 64  # torch's CPU allocator's alignment


def one_rank_align(shard_size: int, *dtypes: torch.dtype) -> int:
    """The :attr:`ShardSpec.align` of a unit's parameters: with one rank (``shard_size`` 1) the
    elements of :data:`ALIGN_BYTES` in the smallest of ``dtypes`` (the shards' and the compute
    dtype: each parameter then starts on a 64-byte line in the local and in the full flat buffer,
    whose offsets are equal at one rank), otherwise 1.

    Why: forward then computes on weights aligned as torch's separately allocated ones are; a
    one-row ``F.linear`` on CPU rounds differently for a weight that starts elsewhere, so a
    one-rank unit packed back to back is not bitwise torch's.
    """
    return ALIGN_BYTES // min(d.itemsize for d in dtypes) if shard_size == 1 and dtypes else 1


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Geometry of one parameter sharded over ``shard_size`` ranks; this process is ``rank``.

    Attributes:
        orig_shape: the full parameter's shape.
        shard_size: number of ranks in the shard group (N).
        rank: this process's rank in the shard group.
        dim: the shard dim (0 <= dim < len(orig_shape); 0 for a 0-dim parameter); "rows" below
            are the indices along it.
        align: the padded shard size is a multiple of this many elements (see
            :func:`one_rank_align`; 1 with several ranks).

    The derived sizes below are computed once per spec (the fields are frozen): the hooks read
    them for every parameter of every unit at each gather and reduction.
    """

    orig_shape: torch.Size
    shard_size: int
    rank: int
    dim: int = 0
    align: int = 1

    @functools.cached_property
    def rows(self) -> int:
        """The full number of rows, ``orig_shape[dim]`` (1 for a 0-dim parameter)."""
        return self.orig_shape[self.dim] if len(self.orig_shape) > 0 else 1

    @functools.cached_property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row: the other dims."""
        return tuple(s for i, s in enumerate(self.orig_shape) if i != self.dim)

    @functools.cached_property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @functools.cached_property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @functools.cached_property
    def chunk_rows(self) -> int:
        """Rows per rank before the tail: ceil(d0 / N)."""
        return -(-self.rows // self.shard_size)

    @functools.cached_property
    def chunk_numel(self) -> int:
        """Elements of ``chunk_rows`` rows: the padded shard before the alignment."""
        return self.chunk_rows * self.row_numel

    @functools.cached_property
    def padded_shard_numel(self) -> int:
        """Elements of one rank's padded shard (identical on every rank): ``chunk_numel``
        rounded up to a multiple of ``align``."""
        return -(-self.chunk_numel // self.align) * self.align

    @functools.cached_property
    def padded_numel(self) -> int:
        """Elements of the padded full parameter: N x padded shard size."""
        return self.shard_size * self.padded_shard_numel

    def rows_of(self, rank: int) -> int:
        """Real (unpadded) rows held by ``rank``; 0 for ranks past the end."""
        start = rank * self.chunk_rows
        return max(0, min(self.chunk_rows, self.rows - start))

    @functools.cached_property
    def local_rows(self) -> int:
        return self.rows_of(self.rank)

    @functools.cached_property
    def local_row_start(self) -> int:
        return min(self.rank * self.chunk_rows, self.rows)

    @functools.cached_property
    def local_shape(self) -> torch.Size:
        return self.shape_with_rows(self.local_rows)

    def shape_with_rows(self, rows: int) -> torch.Size:
        """``orig_shape`` with ``rows`` rows along the shard dim."""
        if self.dim == 0:
            return torch.Size((rows, *self.row_shape))
        return torch.Size((*self.orig_shape[: self.dim], rows, *self.orig_shape[self.dim + 1 :]))

    @functools.cached_property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor of ``orig_shape`` (a view, shape ``local_shape``;
        not contiguous for a shard dim > 0 unless one rank holds everything)."""
        if self.dim != 0:
            return full.reshape(self.orig_shape).narrow(self.dim, self.local_row_start, self.local_rows)
        flat_rows = full.reshape(self.rows, *self.row_shape)
        start = self.local_row_start
        return flat_rows[start : start + self.local_rows]

    def ranked_to_full(self, ranked: torch.Tensor, full: torch.Tensor, first: int = 0) -> None:
        """Copy an all-gather's output into the full tensor, for a shard dim > 0.

        Args:
            ranked: shape (M, padded shard size), rows possibly strided (a gathered run's
                columns): row i holds rank ``first + i``'s shard, contiguous in its own shape,
                then padding (M = N, ``first`` = 0: every rank's).
            full: shape ``orig_shape``, any strides; each rank's shard goes to its rows along dim.
            first: the rank of ``ranked``'s first row.
        """
        m, chunk = ranked.shape[0], self.chunk_rows
        if chunk == 0:
            return
        if self.rows == self.shard_size * chunk:  # even: one strided copy
            full.unflatten(self.dim, (self.shard_size, chunk)).movedim(self.dim, 0)[first : first + m].copy_(
                ranked[:, : self.chunk_numel].view(m, *self.shape_with_rows(chunk))
            )
            return
        for i in range(m):
            rows = self.rows_of(first + i)
            if rows:
                shape = self.shape_with_rows(rows)
                full.narrow(self.dim, (first + i) * chunk, rows).copy_(ranked[i, : shape.numel()].view(shape))

    def full_to_ranked(self, full: torch.Tensor, ranked: torch.Tensor) -> None:
        """Copy a full tensor (a gradient) into a rank-major pack, for a shard dim > 0: the
        inverse of :meth:`ranked_to_full`, zeros in the padding.

        Args:
            full: shape ``orig_shape``, any strides and dtype (cast by the copy).
            ranked: shape (N, padded shard size), rows possibly strided (a pack's columns).
        """
        n, chunk = self.shard_size, self.chunk_rows
        if self.rows == n * chunk:
            ranked[:, : self.chunk_numel].view(n, *self.shape_with_rows(chunk)).copy_(
                full.unflatten(self.dim, (n, chunk)).movedim(self.dim, 0)
            )
            ranked[:, self.chunk_numel :].zero_()  # the alignment (one rank)
            return
        for r in range(n):
            rows = self.rows_of(r)
            size = self.shape_with_rows(rows).numel()
            if rows:
                ranked[r, :size].view(self.shape_with_rows(rows)).copy_(full.narrow(self.dim, r * chunk, rows))
            ranked[r, size:].zero_()


@dataclasses.dataclass
class ParamSlot:
    """Where an original parameter lives in the module tree (one parameter can have several)."""

    module: nn.Module
    attr: str


class ShardedParam:
    """One original parameter of a unit: its geometry, its registered shard and its places.

    Args:
        spec: the shard geometry.
        slots: every (module, attribute) where the original parameter was registered.
        fqn: the parameter's fully qualified name in the unwrapped model.
        requires_grad: whether the original parameter required a gradient.
    """

    def __init__(self, spec: ShardSpec, slots: list[ParamSlot], fqn: str, requires_grad: bool) -> None:
        self.spec = spec
        self.slots = slots
        self.fqn = fqn
        self.requires_grad = requires_grad
        self.shard: nn.Parameter | None = None
        self.shard_group: Any = None  # the unit's shard group (None: one rank holds it whole)
        self.local_offset = 0  # element offset in the unit's local flat buffer
        self.full_offset = 0  # element offset in the unit's full flat buffer
        self.dtensor_spec: Any = None  # a DTensorSpec when the shard is registered as a DTensor
        self.swapped = False  # for now another tensor is registered in the shard's place, or the shard shows one
        self.local_param: nn.Parameter | None = (
            None  # a plain Parameter over a DTensor's local shard, for optimizer steps
        )
        # A tensor-parallel parameter's DTensorSpec on its tp mesh: ``spec`` then describes its
        # local tensor, and forward sees the full (TP-local) value as a DTensor of this spec.
        self.tp_spec: Any = None

    @property
    def local(self) -> torch.Tensor:
        """The registered shard's plain tensor, shape ``spec.local_shape`` (a DTensor's local tensor)."""
        assert self.shard is not None
        return local_tensor(self.shard)

    def point_at(self, view: torch.Tensor) -> None:
        """Make the registered shard's storage ``view`` (shape ``spec.local_shape``, a view of
        the unit's local flat buffer): its ``.data`` for a plain tensor, a DTensor's local tensor.
        Its values are the caller's to have copied."""
        shard: Any = self.shard
        assert shard is not None
        if local_tensor(shard) is shard:
            shard.data = view
        else:
            compat.set_dtensor_local(shard, view)
        shard._fullshard_param = self  # lost by a tensor swap (to_empty)

    def local_grad(self) -> torch.Tensor | None:
        """The shard's gradient as a plain tensor of the shard's shape, or None."""
        assert self.shard is not None
        grad = self.shard.grad
        return None if grad is None else local_tensor(grad)

    def as_registered(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (shape ``spec.local_shape``) as the registered shard presents it: itself, or
        a DTensor of the full shape over the unit's mesh sharing its storage."""
        spec = self.dtensor_spec
        if spec is None:
            return local
        if local.dtype != spec.tensor_meta.dtype:  # e.g. optimizer state kept in another dtype
            meta = spec.tensor_meta
            spec = compat.make_dtensor_spec(spec.mesh, spec.placements, meta.shape, meta.stride, local.dtype)
        return compat.dtensor_from_spec(local, spec)

    def set_grad(self, grad: torch.Tensor) -> None:
        """Make ``grad`` (a plain tensor of the shard's shape) the shard's ``.grad``; one of
        another floating dtype (``keep_low_precision_grads``) through :func:`assign_grad`."""
        assert self.shard is not None
        if grad.dtype != self.shard.dtype:
            assign_grad(self.shard, grad)
        else:
            self.shard.grad = self.as_registered(grad)

    def run_grad_hooks(self) -> None:
        """Run the shard's ``register_post_accumulate_grad_hook`` hooks, once its ``.grad`` holds
        the reduced gradient (autograd never accumulates into the shard itself), as torch's
        ``fully_shard`` does after its reduce-scatter: optimizer-in-backward steps there."""
        hooks = getattr(self.shard, "_post_accumulate_grad_hooks", None)
        for hook in list(hooks.values()) if hooks else ():
            hook(self.shard)

    def register_shard(self, shard: nn.Parameter) -> None:
        """Put ``shard`` in place of the original parameter at every slot."""
        shard._fullshard_param = self  # type: ignore[attr-defined]
        self.shard = shard
        self.swapped = False
        for slot in self.slots:
            compat.module_parameters(slot.module)[slot.attr] = shard

    def swap_registered(self, param: nn.Parameter) -> None:
        """Register ``param`` instead of the shard at every slot (``register_shard`` undoes it)."""
        self.swapped = True
        for slot in self.slots:
            compat.module_parameters(slot.module)[slot.attr] = param

    def unsharded(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (shape ``orig_shape``) as forward sees it: itself, or for a tensor-parallel
        parameter a DTensor of :attr:`tp_spec` whose local tensor it is (differentiable: the
        DTensor's gradient comes back to ``full`` as a plain tensor of its shape)."""
        spec = self.tp_spec
        if spec is None:
            return full
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            full, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )

    def install_full(self, full: torch.Tensor) -> None:
        """Make ``module.attr`` resolve to ``full`` (shape ``orig_shape``; a DTensor for a
        tensor-parallel parameter, see :meth:`unsharded`) at every slot.

        The full tensor goes into the instance ``__dict__``, which attribute lookup consults
        before ``nn.Module.__getattr__``; ``_parameters`` keeps the shard, so
        ``module.parameters()`` still yields shards.
        """
        full = self.unsharded(full)
        for slot in self.slots:
            slot.module.__dict__[slot.attr] = full

    def uninstall_full(self) -> None:
        for slot in self.slots:
            slot.module.__dict__.pop(slot.attr, None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind ``t``: a DTensor's local tensor, else ``t`` itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (a process saves 0.7 s)
    return compat.dtensor_local(t) if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def assign_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Make ``grad`` (``param``'s shape, any floating dtype, or None) ``param.grad``.

    autograd refuses a ``.grad`` whose dtype differs from its tensor's; FSDP1's
    ``MixedPrecision(keep_low_precision_grads=True)`` keeps float16 / bfloat16 gradients on float32
    shards (as torch's FSDP1 does), so such a gradient goes in through a placeholder of the
    parameter's dtype whose ``.data`` it then becomes (``.data`` takes any dtype).
    """
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
        return
    param.grad = torch.empty_strided(grad.shape, (0,) * grad.dim(), dtype=param.dtype, device=grad.device)
    param.grad.data = grad


def unshifted(dtensor: Any) -> Any:
    """``dtensor`` (a DTensor not requiring grad) with a wrapper at storage offset 0, sharing its
    local tensor and spec; itself when already so.

    torch's DTensor constructor copies the local tensor's storage offset onto the wrapper, which
    owns no memory: a shard viewed at an offset of a unit's flat buffer then gives a DTensor
    whose ``data_ptr()`` is nonzero, and ``torch.distributed.checkpoint.async_save``'s staging
    takes that for memory of the wrapper's own ("Attempted to call copy_() on an invalid python
    storage"). torch's FSDP2 shards each start a storage of their own, so theirs never do.
    """
    if dtensor.storage_offset() == 0 or dtensor.requires_grad:
        return dtensor
    local = compat.dtensor_local(dtensor)
    at_zero = local.detach().as_strided(local.size(), local.stride(), 0)  # same storage, nothing allocated
    out = compat.dtensor_from_spec(at_zero, compat.dtensor_spec(dtensor))
    compat.set_dtensor_local(out, local)
    return out


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a shard registered by a fullshard unit."""
    return hasattr(param, "_fullshard_param")
