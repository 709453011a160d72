"""An FSDP unit's layout: its sharded parameters and flat buffers, built once.

The :class:`~fullshard.engine.unit.Unit` adds the all-gather, reshard and reduction on top;
the modules that work on the buffers (:mod:`.reduce`, :mod:`.shard_sync`) take a layout.


A unit keeps two flat buffers (see :mod:`fullshard.engine.sharded_param` for the vocabulary):

- the **local flat buffer**, shape (S,), S = sum of the padded shard sizes, in the parameters'
  own dtype: this rank's shards back to back, each padded to its padded shard size. The
  registered shard parameters are views into it. With CPU offload it lives in (pinned) CPU
  memory; otherwise on the compute device, where it is the all-gather input as it stands.
- the **full flat buffer**, shape (N*S,), in the compute dtype (``param_dtype`` under mixed
  precision) on the compute device: padded full parameters back to back (param-major). It is an
  autograd leaf: each forward takes per-parameter views of it, so the gradients of all the
  unit's parameters accumulate into one flat gradient, and one post-accumulate-grad hook says
  when the unit's gradient is complete. Its storage is empty (0 bytes) while the unit is
  SHARDED; autograd's saved views keep pointing at it and see the data again after the next
  unshard refills it (on CPU with memory acquired from ``buffers.POOL``, elsewhere by a resize).
  Once the last backward that reads it has run, it is emptied before the gradients are packed,
  and the packed gradient takes the same memory. With one rank, no casting and no offload it
  aliases the local buffer.

With one rank each padded shard is rounded up to 64 bytes (``ShardSpec.align``), so that every
parameter starts on a 64-byte line in both buffers (their offsets are equal at one rank), as
torch's separately allocated parameters do: a one-row ``F.linear`` on CPU rounds differently for
a weight that starts elsewhere. The alignment is padding like the rest.

Gradients come back rank-major: the full flat buffer's ``.grad`` is laid out like N local flat
buffers (trainable prefix) back to back, which is the reduce-scatter's input with no further copy.

Trainable parameters come first in both buffers and frozen ones (``requires_grad=False``) last,
so the autograd leaf covers only the trainable prefix of the full buffer: frozen parameters are
gathered with the rest but get no gradient memory and no gradient communication.

A parameter sharded along a dim d > 0 (``fully_shard``'s ``Shard(d)``) is laid out the same way,
its shard contiguous in the shard's own shape, and its region of the full buffer holds the full
parameter: the copy-out rearranges each gathered shard straight to its rows along d
(:meth:`UnitLayout.copy_out_ranked`), so it is never gathered in place; its gradient is packed
shard by shard (:meth:`ShardSpec.full_to_ranked`).

An all-gather's output is rank-major; the copy-out to the param-major full buffer is one
``split_with_sizes_copy`` (on gloo, of the other ranks' rows only: ours go there from the
shards directly, see ``Unit._gather_into``). On gloo each large parameter is gathered on its
own, straight into its region of the full buffer, which needs no copy-out (see
``UnitLayout._plan_pieces``; one sharded along a dim > 0 through a scratch buffer). Gradients
go the other way, in :mod:`.reduce`: per-parameter gradients -> one packing copy, rank-major
(N*S_t,) -> reduce-scatter -> (S_t,) -> the shards' ``.grad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine.dynamo_guard import outside_dynamo
from fullshard.engine.sharded_param import ParamSlot, ShardedParam, ShardSpec, one_rank_align
from fullshard.engine.unit_config import UnitConfig

ParamEntry = tuple[str, nn.Parameter, list[ParamSlot]]

# On gloo, a parameter whose padded shard has at least this many bytes is all-gathered on its
# own, straight into the full buffer; smaller ones are gathered in runs and copied out.
DIRECT_GATHER_BYTES = 1 << 20


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on the same storage as ``t`` with its own version counter (no autograd)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return out


def real_views(flat: torch.Tensor, splits: list[int], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of the parameters packed in ``flat``, each followed by its padding.

    Args:
        flat: 1-D, ``sum(splits)`` elements.
        splits: (real elements, padding) per parameter, alternating.
        shapes: each parameter's shape; ``shapes[i]`` has ``splits[2 * i]`` elements.

    Returns:
        one view of ``flat`` per parameter, from a single ``split_with_sizes``.
    """
    pieces = flat.split_with_sizes(splits)
    return [pieces[2 * i].view(shape) for i, shape in enumerate(shapes)]


def gather_pieces(shard_bytes: Sequence[int], direct: bool) -> list[list[int]]:
    """How a unit's all-gather is split into collectives: the indices of the parameters each
    one takes, in layout order (the engine's :meth:`UnitLayout._plan_pieces` and the planner's
    :func:`fullshard.plan.unit_buffers.unit_buffers` both follow it).

    Args:
        shard_bytes: each parameter's padded shard in bytes (compute dtype), in layout order.
        direct: split at large parameters (gloo): each one of at least
            :data:`DIRECT_GATHER_BYTES` is a piece of its own, the runs between them one piece
            each. Otherwise the whole unit is one piece.

    Returns:
        the pieces, none empty; a piece of one parameter is gathered straight into place, one
        of several through a scratch buffer.
    """
    pieces: list[list[int]] = []
    run: list[int] = []
    for i, n in enumerate(shard_bytes):
        if direct and n >= DIRECT_GATHER_BYTES:
            pieces += [run, [i]] if run else [[i]]
            run = []
        else:
            run.append(i)
    return pieces + [run] if run else pieces


class UnitLayout:
    """The sharded parameters of one FSDP unit, laid out in its flat buffers.

    Args:
        name: a label for error messages (the wrapped module's qualified name).
        params: (fqn, original parameter, slots) for each parameter the unit owns; all of one
            dtype and device.
        shard_group: process group the parameters are sharded over (``shard_size`` = N ranks),
            or None for one.
        replicate_group: optional group over which gradients are all-reduced after the
            reduce-scatter (``replicate_size`` ranks; NO_SHARD uses a shard group of one rank
            and the world here).
        config: compute device, dtypes, offload and resharding.

    Raises:
        ValueError: parameters of different dtypes or devices in one unit.
    """

    def __init__(
        self,
        name: str,
        params: list[ParamEntry],
        shard_group: collectives.ProcessGroup | None,
        replicate_group: collectives.ProcessGroup | None,
        config: UnitConfig,
    ) -> None:
        self.name = name
        self.config = config
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.shard_size = collectives.group_size(shard_group) if shard_group is not None else 1
        self.rank = collectives.group_rank(shard_group) if shard_group is not None else 0
        self.replicate_size = collectives.group_size(replicate_group) if replicate_group is not None else 1
        self.params: list[ShardedParam] = []
        self.dtype = self._common_dtype(params)
        self.device = config.compute_device
        self.compute_dtype = config.param_dtype or self.dtype
        self.reduce_dtype = config.reduce_dtype or self.compute_dtype
        # Settings the front ends change between steps (FSDP2's set_* methods).
        self.all_reduce_grads = True  # False: reduce-scatter only; the replica all-reduce waits
        self.divide_factor: float | None = None  # None: average over the data-parallel ranks
        self.on_grad_ready: Callable[[Any], None] | None = None  # called with the unit
        self.on_relayout: Callable[[], None] | None = None  # after relayout_trainable (the tree's pool plan)
        # Indices into ``trainable`` of parameters frozen while unreduced gradients wait (see
        # Unit.defer_relayout): laid out as trainable until that reduction, given no gradient.
        self.frozen_pending: list[int] | None = None
        self._build(params)

    @property
    def has_trainable(self) -> bool:
        """Whether backward can give this unit gradients to reduce (some parameter requires grad)."""
        return bool(self.trainable)

    @property
    def first_data_parallel_rank(self) -> bool:
        """Whether this rank is rank 0 of both the shard and the replicate group: where
        ``rank0_only`` keeps full state. Rank 0 of the world when the groups span it; on a slice of
        a mesh (beside pipeline stages) the first rank of each slice, which holds another model."""
        return self.rank == 0 and (self.replicate_group is None or collectives.group_rank(self.replicate_group) == 0)

    def _common_dtype(self, params: list[ParamEntry]) -> torch.dtype:
        kinds = {(p.dtype, p.device) for _, p, _ in params}
        if len(kinds) > 1:
            listing = ", ".join(f"{fqn}: {p.dtype} on {p.device}" for fqn, p, _ in params)
            raise ValueError(
                f"FSDP unit {self.name!r} holds parameters of several dtypes or devices "
                f"({listing}); move the module to one device and dtype before wrapping "
                "(module.to(device, dtype)), or wrap the differing submodules as their own units"
            )
        return kinds.pop()[0] if kinds else torch.float32

    @property
    def shard_device(self) -> torch.device:
        return torch.device("cpu") if self.config.offload else self.device

    def _build(self, params: list[ParamEntry]) -> None:
        params = [e for e in params if e[1].requires_grad] + [e for e in params if not e[1].requires_grad]
        align = one_rank_align(self.shard_size, self.dtype, self.compute_dtype)
        for fqn, p, slots in params:
            # fully_shard's shard_placement_fn may choose another dim (set on the parameter by it)
            spec = ShardSpec(p.shape, self.shard_size, self.rank, getattr(p, "_fullshard_shard_dim", 0), align)
            sp = ShardedParam(spec, slots, fqn, p.requires_grad)
            sp.tp_spec = getattr(p, "_fullshard_tp_spec", None)  # set by fully_shard for a TP DTensor
            sp.shard_group = self.shard_group
            self.params.append(sp)
        self._place()
        # On the meta device (fully_shard of a model built under torch.device("meta")) the
        # shards stay meta until the program materializes them (to_empty, then its own init);
        # the buffers are allocated when the first unshard finds real values (shard_sync).
        self.meta = any(p.is_meta for _, p, _ in params)
        self.local_flat = self._new_local_flat()
        with torch.no_grad():
            for (_, p, _), sp in zip(params, self.params):
                view = self.local_view(sp)
                if not self.meta:
                    view.copy_(sp.spec.local_slice(p.detach()))
                if self.config.keep_param_objects and not self.meta:
                    p.data, p.grad = view, None  # the user's Parameter is now the shard
                    sp.register_shard(p)
                else:
                    sp.register_shard(nn.Parameter(view, requires_grad=p.requires_grad))
                    p._fullshard_sharded_as = sp.fqn  # type: ignore[attr-defined]  # met again: tied
        self._plan_buffers()

    def _place(self) -> None:
        """Offsets and sizes of :attr:`params` in their order (the trainable ones first)."""
        local_off = full_off = 0
        for sp in self.params:
            sp.local_offset, sp.full_offset = local_off, full_off
            local_off += sp.spec.padded_shard_numel
            full_off += sp.spec.padded_numel
        self.shard_numel = local_off  # S
        self.trainable = [sp for sp in self.params if sp.requires_grad]
        self.grad_numel = sum(sp.spec.padded_shard_numel for sp in self.trainable)  # S_t <= S
        self._full_splits = [
            [n for sp in group for n in (sp.spec.numel, sp.spec.padded_numel - sp.spec.numel)]
            for group in (self.trainable, self.params[len(self.trainable) :])
        ]
        # The trainable shards in a buffer laid out like the local flat buffer's first S_t
        # elements: (real elements, padding) per parameter, for one split instead of a slice each.
        self._grad_splits = [
            n for sp in self.trainable for n in (sp.spec.local_numel, sp.spec.padded_shard_numel - sp.spec.local_numel)
        ]
        # Parameters sharded along a dim > 0: rearranged on the way out of each all-gather
        # (:meth:`copy_out_ranked`), and never gathered straight into their region.
        self.dim_params = [sp for sp in self.params if sp.spec.dim != 0]

    def _plan_buffers(self) -> None:
        """What follows from the dtypes and the local flat buffer: the all-gather's pieces,
        whether the full buffer aliases the shards, and (real values only) the full buffers."""
        self._pieces = self._plan_pieces()
        self._run_sizes = [[sp.spec.padded_shard_numel for sp in group] for group, _, _ in self._pieces]
        self._run_dims = [any(sp.spec.dim != 0 for sp in group) for group, _, _ in self._pieces]
        # With one rank, no cast and no offload the full buffer is the local buffer itself.
        self.aliased = self.shard_size == 1 and self.compute_dtype == self.dtype and not self.config.offload
        self.shard_ptrs = [self.local_view(sp).data_ptr() for sp in self.params]
        if not self.meta:
            self._allocate_buffers()

    def defer_relayout(self, flipped: list[ShardedParam]) -> bool:
        """Whether the change of ``flipped``'s ``requires_grad`` waits (the unit keeps its layout
        for now); here never."""
        return False

    def relayout_refusal(self) -> str | None:
        """Why :meth:`relayout_trainable` may not run now (the end of an error message), or None."""
        return self.layout_fixed()

    def layout_fixed(self) -> str | None:
        """Why :meth:`relayout_trainable` may never run for this unit (the end of an error
        message), or None: such a change is refused at once, never deferred."""
        return None

    def relayout_trainable(self) -> None:
        """Lay the buffers out again for the parameters' current ``requires_grad`` (set on the
        registered shards since the unit was built, as torch's FSDP2 allows): the trainable
        ones first, the local flat buffer rebuilt with the same values and each shard a view of
        it again, the full buffers and the gradient's size planned anew. For a unit whose full
        parameters no pending backward reads and that holds no unreduced gradient (the caller
        checks); gradients already in the shards' ``.grad`` stay as they are."""
        old = {id(sp): self.local_view(sp) for sp in self.params}
        self.frozen_pending = None
        for sp in self.params:
            assert sp.shard is not None
            sp.requires_grad = sp.shard.requires_grad
        self.params = [sp for sp in self.params if sp.requires_grad] + [
            sp for sp in self.params if not sp.requires_grad
        ]
        self._place()
        self.local_flat = self._new_local_flat()
        with torch.no_grad():
            for sp in self.params:
                view = self.local_view(sp)
                view.copy_(old[id(sp)])
                sp.point_at(view)
        self._plan_buffers()

    def recast_shards(self, dtype: torch.dtype) -> None:
        """Hold the shards in ``dtype`` from now on, values cast: the local flat buffer is
        rebuilt and each registered shard (the user's Parameter, FSDP1 wrapper) becomes a view of
        it. The compute and reduce dtypes stay what they were (without mixed precision, the
        dtype the unit was built in), as torch FSDP1's do when Accelerate upcasts its
        low-precision flat parameters to float32 master weights this way. For a unit that was
        never gathered (the caller checks)."""
        values = self.local_flat
        self.dtype = dtype
        self.local_flat = self._new_local_flat()
        with torch.no_grad():
            self.local_flat.copy_(values)
            for sp in self.params:
                sp.point_at(self.local_view(sp))
        self._plan_buffers()

    def _new_local_flat(self) -> torch.Tensor:
        if self.meta:
            return torch.zeros(self.shard_numel, dtype=self.dtype, device="meta")
        pin = self.config.offload and torch.cuda.is_available()
        return torch.zeros(self.shard_numel, dtype=self.dtype, device=self.shard_device, pin_memory=pin)

    def _allocate_buffers(self) -> None:
        """The full flat buffer (storage emptied until the first unshard), its autograd leaf and
        views, for a unit whose local flat buffer holds real values."""
        full = (
            _alias(self.local_flat)
            if self.aliased
            else torch.empty(self.shard_size * self.shard_numel, dtype=self.compute_dtype, device=self.device)
        )
        self.full_data = _alias(full)  # writes here leave autograd's version counter alone
        # The autograd leaf (trainable prefix) and the frozen rest: aliases of one storage.
        split = self.shard_size * self.grad_numel
        self.full_flat = _alias(full[:split]).requires_grad_(bool(self.trainable))
        self.frozen_full = _alias(full[split:])
        # Per run piece, its copy-out targets: views of the full buffer, built once (they stay
        # valid across resize_, which keeps the storage object).
        self._run_targets = [
            [
                self.full_data[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(self.shard_size, -1)
                for sp in group
            ]
            for group, _, _ in self._pieces
        ]
        if not self.aliased:
            full.untyped_storage().resize_(0)
        if self.trainable:
            # Through a weak reference: the tensor's hook table is invisible to Python's cycle
            # collector, so a bound method here would keep the unit (and its process group,
            # whose threads then outlive the interpreter) alive forever.
            self.full_flat.register_post_accumulate_grad_hook(_weak_hook(self))

    def pooled_sizes(self) -> list[tuple[int, torch.dtype]]:
        """The (numel, dtype) of the buffers this unit takes from ``buffers.POOL`` on CPU: the
        full flat buffer, the packed gradient, then the all-gather's scratch for each piece that
        goes through one (a run of parameters, or a lone parameter sharded along a dim > 0), in
        piece order (the reductions' own buffers aside)."""
        n, dtype = self.shard_size, self.compute_dtype
        sizes = [(n * self.shard_numel, dtype), (n * self.grad_numel, dtype)]
        pieces = zip(self._pieces, self._run_dims)
        return sizes + [(n * length, dtype) for (group, _, length), dims in pieces if len(group) > 1 or dims]

    def copy_out_ranked(
        self,
        ranked: torch.Tensor,
        group: Sequence[ShardedParam],
        sizes: list[int],
        targets: list[torch.Tensor],
        first: int = 0,
        dims: bool = True,
    ) -> None:
        """Copy rank-major gathered rows into the parameters' regions of a full flat buffer.

        Args:
            ranked: shape (M, sum(sizes)), rows possibly strided: row i holds rank ``first + i``'s
                padded shards of ``group``, back to back (an all-gather's output, or rows of it).
            group: the parameters, in layout order.
            sizes: each parameter's padded shard size.
            targets: each parameter's region of the full buffer, viewed (N, padded shard size).
            first: the rank of ``ranked``'s first row.
            dims: whether ``group`` may hold a parameter sharded along a dim > 0 (False: it holds
                none, and all of them go in one ``split_with_sizes_copy``).

        A parameter sharded along a dim > 0 is rearranged on the way, straight into its full
        tensor (:meth:`ShardSpec.ranked_to_full`; its region's padding is left as it was), so it
        is copied once like the others; each stretch of the others between them is still one
        ``split_with_sizes_copy`` (one kernel on a GPU).
        """
        m = ranked.shape[0]
        if not dims:
            torch.split_with_sizes_copy(ranked, sizes, dim=1, out=[t[first : first + m] for t in targets])
            return
        i = col = 0
        while i < len(group):
            spec = group[i].spec
            if spec.dim != 0:
                full = targets[i].view(-1)[: spec.numel].view(spec.orig_shape)
                spec.ranked_to_full(ranked[:, col : col + sizes[i]], full, first)
                col, i = col + sizes[i], i + 1
                continue
            j = i + 1
            while j < len(group) and group[j].spec.dim == 0:
                j += 1
            width = sum(sizes[i:j])
            outs = [t[first : first + m] for t in targets[i:j]]
            torch.split_with_sizes_copy(ranked[:, col : col + width], sizes[i:j], dim=1, out=outs)
            col, i = col + width, j

    def _plan_pieces(self) -> list[tuple[list[ShardedParam], int, int]]:
        """How the all-gather is split: (parameters, local offset, local length) per collective.

        On gloo every parameter whose padded shard reaches :data:`DIRECT_GATHER_BYTES` is its
        own all-gather, straight into the full buffer (no temporary, no copy-out: gloo's
        collectives are N broadcasts each, so a piece costs one round of latency and no
        extra bandwidth; one sharded along a dim > 0 lands in a scratch buffer instead, which the
        copy-out rearranges from); the parameters between them are gathered as runs. Elsewhere (NCCL,
        where many small collectives cost more than a copy on the GPU) the unit is one piece.
        """
        gloo = self.shard_group is not None and collectives.backend(self.shard_group) == "gloo"
        nbytes = [sp.spec.padded_shard_numel * self.compute_dtype.itemsize for sp in self.params]
        pieces: list[tuple[list[ShardedParam], int, int]] = []
        for idx in gather_pieces(nbytes, gloo):
            group = [self.params[i] for i in idx]
            start = group[0].local_offset
            pieces.append((group, start, group[-1].local_offset + group[-1].spec.padded_shard_numel - start))
        return pieces

    def trainable_local_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each trainable parameter's shard in ``flat`` (shape (S_t,), laid out like the local
        flat buffer's first S_t elements), shapes ``spec.local_shape``: :meth:`local_view` of
        each, from one split."""
        return real_views(flat, self._grad_splits, [sp.spec.local_shape for sp in self.trainable])

    def local_view(self, sp: ShardedParam, flat: torch.Tensor | None = None) -> torch.Tensor:
        n = sp.spec.local_numel
        source = self.local_flat if flat is None else flat
        return source[sp.local_offset : sp.local_offset + n].view(sp.spec.local_shape)

    @property
    def full_nbytes(self) -> int:
        """Bytes of the full flat buffer while gathered (0 when it aliases the shards)."""
        return 0 if self.aliased else self.shard_size * self.shard_numel * self.compute_dtype.itemsize

    @property
    def sharded_nbytes(self) -> int:
        return self.shard_numel * self.local_flat.element_size()

    def materialize(self) -> None:
        """Leave the meta device: real buffers on the shard device, into which the caller then
        copies the values the program gave the shards (``to_empty`` and its own init).

        Raises:
            RuntimeError: a shard is still on the meta device.
        """
        still = [sp.fqn for sp in self.params if sp.local.is_meta and sp.spec.local_numel > 0]
        if still:
            raise RuntimeError(
                f"FSDP unit {self.name!r}: parameters {still} are still on the meta device; call "
                "model.to_empty(device=...) and initialize them (e.g. model.reset_parameters()), or "
                "load a state dict with assign=True, before the first forward"
            )
        self.meta = False
        self.local_flat = self._new_local_flat()
        self.shard_ptrs = [self.local_view(sp).data_ptr() for sp in self.params]
        self._allocate_buffers()

    def _grad_accumulated(self, full_flat: torch.Tensor) -> None:
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)


def _weak_hook(unit: UnitLayout) -> Callable[[torch.Tensor], None]:
    """``unit``'s gradient-ready hook, holding the unit only weakly."""
    ref = weakref.ref(unit)

    @outside_dynamo  # autograd calls it: from a compiled step's backward too, never to be traced
    def hook(full_flat: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            target._grad_accumulated(full_flat)

    return hook
