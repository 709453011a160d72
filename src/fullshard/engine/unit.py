"""FSDP unit: the parameters one wrapped module owns, gathered and reduced together.

A unit keeps two flat buffers (see ``_sharded_param`` for the vocabulary):

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
  unshard refills it (on CPU with memory lent from ``_buffers.POOL``, elsewhere by a resize).
  Once the last backward that reads it has run, it is emptied before the gradients are packed,
  and the packed gradient takes the same memory. With one rank, no casting and no offload it
  aliases the local buffer.

Gradients come back rank-major: the full flat buffer's ``.grad`` is laid out like N local flat
buffers (trainable prefix) back to back, which is the reduce-scatter's input with no further copy.

Trainable parameters come first in both buffers and frozen ones (``requires_grad=False``) last,
so the autograd leaf covers only the trainable prefix of the full buffer: frozen parameters are
gathered with the rest but get no gradient memory and no gradient communication.

An all-gather's output is rank-major; the copy-out to the param-major full buffer is one
``split_with_sizes_copy``. On gloo each large parameter is gathered on its own, straight into
its region of the full buffer, which needs no copy-out (see ``Unit._plan_pieces``). Gradients
go the other way, in ``_reduce``: per-parameter gradients -> one packing copy, rank-major
(N*S_t,) -> reduce-scatter -> (S_t,) -> the shards' ``.grad``.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fullshard.comm import buffers, collectives
from fullshard.engine import partial_reshard, reduce, shard_sync
from fullshard.engine.reduce import _Multi
from fullshard.engine.sharded_param import ParamSlot, ShardedParam, ShardSpec

ParamEntry = tuple[str, nn.Parameter, list[ParamSlot]]


class ShardState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclasses.dataclass(frozen=True)
class UnitConfig:
    """How a unit shards, computes and reduces.

    Attributes:
        compute_device: where forward/backward run and the collectives move data.
        reshard_after_forward: free the full parameters after forward (FULL_SHARD).
        param_dtype: dtype of the all-gather and of compute (None: the parameters' dtype).
        reduce_dtype: dtype of the gradient reduction (None: the compute dtype).
        keep_low_precision_grads: leave the shards' gradients in the reduce dtype.
        offload: keep shards and their gradients in CPU memory (pinned when CUDA exists).
        keep_param_objects: register the original Parameter objects, their ``.data`` now the
            shard (torch FSDP1's ``use_orig_params``: an optimizer built before wrapping trains
            them); otherwise new Parameters.
    """

    compute_device: torch.device
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    offload: bool = False
    keep_param_objects: bool = False


class GatherTracker:
    """Per-process count of units whose full parameters are materialized, with its peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.peak_bytes = 0
        self._bytes = 0

    def add(self, nbytes: int) -> None:
        self.now += 1
        self._bytes += nbytes
        self.peak = max(self.peak, self.now)
        self.peak_bytes = max(self.peak_bytes, self._bytes)

    def remove(self, nbytes: int) -> None:
        self.now -= 1
        self._bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.now
        self.peak_bytes = self._bytes


GATHERED = GatherTracker()

# On gloo, a parameter whose padded shard has at least this many bytes is all-gathered on its
# own, straight into the full buffer; smaller ones are gathered in runs and copied out.
DIRECT_GATHER_BYTES = 1 << 20

# When a list, units and hooks append (event, unit name): "unshard" (all-gather launched),
# "forward" / "forward_end", "backward" (pre-backward) and "reduce". For tests of ordering.
EVENTS: list[tuple[str, str]] | None = None


def record(event: str, unit: Unit) -> None:
    if EVENTS is not None:
        EVENTS.append((event, unit.name))


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on the same storage as ``t`` with its own version counter (no autograd)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return out


class Unit:
    """The sharded parameters of one FSDP unit and the collectives that move them.

    Args:
        name: a label for error messages (the wrapped module's qualified name).
        params: (fqn, original parameter, slots) for each parameter the unit owns; all of one
            dtype and device.
        shard_group: process group the parameters are sharded over (N ranks), or None for one.
        replicate_group: optional group over which gradients are all-reduced after the
            reduce-scatter (NO_SHARD uses a shard group of one rank and the world here).
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
        self.world = collectives.group_size(shard_group) if shard_group is not None else 1
        self.rank = collectives.group_rank(shard_group) if shard_group is not None else 0
        self.replicas = collectives.group_size(replicate_group) if replicate_group is not None else 1
        self.reshard_after_forward = config.reshard_after_forward
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self.params: list[ShardedParam] = []
        self.dtype = self._common_dtype(params)
        self.device = config.compute_device
        self.compute_dtype = config.param_dtype or self.dtype
        self.reduce_dtype = config.reduce_dtype or self.compute_dtype
        self._build(params)
        self._pending_gather: collectives.Handle | None = None
        self._lent: torch.Tensor | None = None  # while gathered from the pool: holds the empty storage
        self._last_reduce_out: torch.Tensor | None = None
        self._host_grad: torch.Tensor | None = None  # under offload: where gradients land on the host
        # The contexts of this unit's _SplitFull nodes that autograd may still run backward on.
        self._open_splits: weakref.WeakSet[Any] = weakref.WeakSet()
        # (handles, output, packed input to give back, output is a partial sum to keep)
        self._pending_reduce: tuple[_Multi, torch.Tensor, torch.Tensor | None, bool] | None = None
        self.sync_grads = True  # False: gradients accumulate unsharded, no reduction (no_sync)
        self.reshard_after_backward = True  # False: stay gathered after backward (FSDP2's setter)
        self.all_reduce_grads = True  # False: reduce-scatter only; the replica all-reduce waits
        self.divide_factor: float | None = None  # None: average over the data-parallel ranks
        self._partial_reduce: torch.Tensor | None = None  # reduce-scattered, not yet all-reduced
        # reshard_after_forward=M: the group of M ranks to reshard to after forward, and this
        # rank's 1/M of the full parameters kept until backward (see _post_forward).
        self.post_forward_group: collectives.ProcessGroup | None = None
        self._partial: torch.Tensor | None = None
        self.on_grad_ready: Callable[[Unit], None] | None = None
        self.on_reshard: Callable[[Unit], None] | None = None  # e.g. register the shards again

    # ---------------------------------------------------------------- construction
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
    def _shard_device(self) -> torch.device:
        return torch.device("cpu") if self.config.offload else self.device

    def _build(self, params: list[ParamEntry]) -> None:
        params = [e for e in params if e[1].requires_grad] + [e for e in params if not e[1].requires_grad]
        local_off = full_off = 0
        for fqn, p, slots in params:
            spec = ShardSpec(p.shape, self.world, self.rank)
            sp = ShardedParam(spec, slots, fqn, p.requires_grad)
            sp.local_offset, sp.full_offset = local_off, full_off
            sp.shard_group = self.shard_group
            local_off += spec.padded_shard_numel
            full_off += spec.padded_numel
            self.params.append(sp)
        self.shard_numel = local_off  # S
        self.trainable = [sp for sp in self.params if sp.requires_grad]
        self.grad_numel = sum(sp.spec.padded_shard_numel for sp in self.trainable)  # S_t <= S
        # On the meta device (fully_shard of a model built under torch.device("meta")) the
        # shards stay meta until the program materializes them (to_empty, then its own init);
        # the buffers are allocated when the first unshard finds real values (_shard_sync).
        self.meta = any(p.is_meta for _, p, _ in params)
        self.local_flat = self._new_local_flat()
        with torch.no_grad():
            for (_, p, _), sp in zip(params, self.params):
                view = self._local_view(sp)
                if not self.meta:
                    view.copy_(sp.spec.local_slice(p.detach()))
                if self.config.keep_param_objects and not self.meta:
                    p.data, p.grad = view, None  # the user's Parameter is now the shard
                    sp.register_shard(p)
                else:
                    sp.register_shard(nn.Parameter(view, requires_grad=p.requires_grad))
                    p._fullshard_sharded_as = sp.fqn  # type: ignore[attr-defined]  # met again: tied
        self._full_splits = [
            [n for sp in group for n in (sp.spec.numel, sp.spec.padded_numel - sp.spec.numel)]
            for group in (self.trainable, self.params[len(self.trainable) :])
        ]
        self._pieces = self._plan_pieces()
        self._run_sizes = [[sp.spec.padded_shard_numel for sp in group] for group, _, _ in self._pieces]
        # With one rank, no cast and no offload the full buffer is the local buffer itself.
        self.aliased = self.world == 1 and self.compute_dtype == self.dtype and not self.config.offload
        self._shard_ptrs = [self._local_view(sp).data_ptr() for sp in self.params]
        if not self.meta:
            self._allocate_buffers()

    def _new_local_flat(self) -> torch.Tensor:
        if self.meta:
            return torch.zeros(self.shard_numel, dtype=self.dtype, device="meta")
        pin = self.config.offload and torch.cuda.is_available()
        return torch.zeros(self.shard_numel, dtype=self.dtype, device=self._shard_device, pin_memory=pin)

    def _allocate_buffers(self) -> None:
        """The full flat buffer (storage emptied until the first unshard), its autograd leaf and
        views, for a unit whose local flat buffer holds real values."""
        full = (
            _alias(self.local_flat)
            if self.aliased
            else torch.empty(self.world * self.shard_numel, dtype=self.compute_dtype, device=self.device)
        )
        self._full_data = _alias(full)  # writes here leave autograd's version counter alone
        # The autograd leaf (trainable prefix) and the frozen rest: aliases of one storage.
        split = self.world * self.grad_numel
        self.full_flat = _alias(full[:split]).requires_grad_(bool(self.trainable))
        self.frozen_full = _alias(full[split:])
        # Per run piece, its copy-out targets: views of the full buffer, built once (they stay
        # valid across resize_, which keeps the storage object).
        self._run_targets = [
            [
                self._full_data[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(self.world, -1)
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

    def _plan_pieces(self) -> list[tuple[list[ShardedParam], int, int]]:
        """How the all-gather is split: (parameters, local offset, local length) per collective.

        On gloo every parameter whose padded shard reaches :data:`DIRECT_GATHER_BYTES` is its
        own all-gather, straight into the full buffer (no temporary, no copy-out: gloo's
        collectives are N broadcasts each, so a piece costs one round of latency and no
        extra bandwidth); the parameters between them are gathered as runs. Elsewhere (NCCL,
        where many small collectives cost more than a copy on the GPU) the unit is one piece.
        """
        gloo = self.shard_group is not None and collectives.backend(self.shard_group) == "gloo"
        pieces: list[tuple[list[ShardedParam], int, int]] = []
        run: list[ShardedParam] = []

        def flush() -> None:
            if run:
                start = run[0].local_offset
                pieces.append((list(run), start, run[-1].local_offset + run[-1].spec.padded_shard_numel - start))
                run.clear()

        for sp in self.params:
            if gloo and sp.spec.padded_shard_numel * self.compute_dtype.itemsize >= DIRECT_GATHER_BYTES:
                flush()
                pieces.append(([sp], sp.local_offset, sp.spec.padded_shard_numel))
            else:
                run.append(sp)
        flush()
        return pieces

    def _local_view(self, sp: ShardedParam, flat: torch.Tensor | None = None) -> torch.Tensor:
        n = sp.spec.local_numel
        source = self.local_flat if flat is None else flat
        return source[sp.local_offset : sp.local_offset + n].view(sp.spec.local_shape)

    @property
    def full_nbytes(self) -> int:
        """Bytes of the full flat buffer while gathered (0 when it aliases the shards)."""
        return 0 if self.aliased else self.world * self.shard_numel * self.compute_dtype.itemsize

    @property
    def sharded_nbytes(self) -> int:
        return self.shard_numel * self.local_flat.element_size()

    # ---------------------------------------------------------------- all-gather
    def _check_state(self, expected: TrainingState | tuple[TrainingState, ...], action: str) -> None:
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if self.training_state not in allowed:
            names = " or ".join(s.name for s in allowed)
            raise RuntimeError(
                f"FSDP unit {self.name!r}: cannot {action} in training state "
                f"{self.training_state.name}, expected {names}"
            )

    def _gather_input(self) -> torch.Tensor:
        """This rank's padded shards on the compute device in the compute dtype."""
        return self.local_flat.to(self.device, self.compute_dtype, non_blocking=True)

    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather that materializes the full parameters."""
        if self.shard_state is ShardState.UNSHARDED or self._pending_gather is not None:
            if not async_op:
                self.wait_unshard()
            return
        shard_sync.sync_shards(self)
        if self.aliased or self.shard_numel == 0:
            self.shard_state = ShardState.UNSHARDED
            GATHERED.add(0)
            return
        record("unshard", self)
        self._allocate_full()
        GATHERED.add(self.full_nbytes)
        if self._partial is not None:  # resharded to a smaller group after forward
            self._pending_gather = partial_reshard.gather_partial(self)
            if not async_op:
                self.wait_unshard()
            return
        if self.world == 1:
            self._full_data.copy_(self.local_flat, non_blocking=True)  # cast and/or upload
            self.shard_state = ShardState.UNSHARDED
            return
        self._pending_gather = self._gather_into(self._full_data, self._gather_input())
        if not async_op:
            self.wait_unshard()

    def _allocate_full(self) -> None:
        """Give the full flat buffer's storage its memory (reused memory on CPU, see ``_buffers``)."""
        data = self._full_data
        self._lent = buffers.lend(data.untyped_storage(), data.numel(), data.dtype, self.device)

    def _free_full(self) -> None:
        """Take the full flat buffer's memory away again (0 bytes; a no-op when already freed)."""
        buffers.take_back(self._full_data.untyped_storage(), self._lent)
        self._lent = None

    def _gather_into(self, full: torch.Tensor, local: torch.Tensor) -> collectives.Handle:
        """Start all-gathering ``local`` (S,) of every rank into the param-major ``full`` (N*S,).

        Each piece of :attr:`_pieces` is one all-gather: a lone parameter lands in its own
        region of ``full`` directly (its N padded shards back to back are its padded full
        tensor); a run of parameters lands rank-major in a scratch buffer from :data:`buffers.POOL`
        (the next unit of the same size reuses it: no fresh pages to fault in) and is copied out.
        """
        n = self.world
        handles: list[collectives.Handle] = []
        copy_outs: list[tuple[torch.Tensor, int]] = []
        for k, (group, start, length) in enumerate(self._pieces):
            src = local[start : start + length]
            if len(group) == 1:
                sp = group[0]
                out = full[sp.full_offset : sp.full_offset + sp.spec.padded_numel]
            else:
                out = buffers.POOL.take(n * length, local.dtype, local.device)
                copy_outs.append((out, k))
            h = collectives.all_gather(out, src, self.shard_group, async_op=True)
            assert h is not None
            handles.append(h)

        def epilogue() -> None:
            for gathered, k in copy_outs:
                group = self._pieces[k][0]
                if full is self._full_data:  # the usual case: views built once at construction
                    outs = self._run_targets[k]
                else:
                    outs = [full[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(n, -1) for sp in group]
                torch.split_with_sizes_copy(gathered.view(n, -1), self._run_sizes[k], dim=1, out=outs)
                buffers.POOL.give(gathered)

        return collectives.Handle(handles, epilogue if copy_outs else None)

    def gather_full(self, local: torch.Tensor) -> list[torch.Tensor]:
        """All-gather a buffer laid out like the local flat buffer, in its own dtype (collective).

        Args:
            local: shape (S,), any dtype and device; typically the shards or their gradients.

        Returns:
            one fresh tensor per parameter, shape ``orig_shape``, on the compute device. The
            unit's own buffers and state are untouched.
        """
        src = local.to(self.device)
        if self.world == 1 or self.shard_numel == 0:
            full = src.clone()
        else:
            full = torch.empty(self.world * self.shard_numel, dtype=src.dtype, device=src.device)
            self._gather_into(full, src).wait()
        return [full[sp.full_offset : sp.full_offset + sp.spec.numel].view(sp.spec.orig_shape) for sp in self.params]

    def local_grads(self) -> torch.Tensor:
        """The shards' gradients packed like the local flat buffer (zeros where None), (S,)."""
        flat = torch.zeros_like(self.local_flat)
        for sp in self.params:
            grad = sp.local_grad()
            if grad is not None:
                self._local_view(sp, flat).copy_(grad)
        return flat

    def wait_unshard(self) -> None:
        """Finish a pending all-gather; the full flat buffer then holds the full parameters."""
        if self._pending_gather is not None:
            self._pending_gather.wait()
            self._pending_gather = None
        self.shard_state = ShardState.UNSHARDED

    def full_params(self) -> list[torch.Tensor]:
        """Per-parameter full tensors (shape ``orig_shape``), views of the full flat buffer.

        Under grad mode the trainable ones come from :class:`_SplitFull`, so their gradients
        accumulate into the full flat buffer's ``.grad``, laid out rank-major (the
        reduce-scatter's input as it stands). Call only while UNSHARDED.
        """
        if self.shard_state is not ShardState.UNSHARDED:
            raise RuntimeError(f"FSDP unit {self.name!r}: full parameters requested while SHARDED")
        views: list[torch.Tensor] = []
        groups = (self.trainable, self.params[len(self.trainable) :])
        for flat, group, sizes in zip((self.full_flat, self.frozen_full), groups, self._full_splits):
            if not group:
                continue
            if flat.requires_grad and torch.is_grad_enabled():
                views += _SplitFull.apply(flat, self)
            else:
                pieces = flat.split(sizes)
                views += [pieces[2 * i].view(sp.spec.orig_shape) for i, sp in enumerate(group)]
        return views

    def reshard_for_packing(self) -> None:
        """Reshard now that autograd has no more use for the full parameters (the last of the
        unit's split nodes is running its backward), so the packed gradient can take their
        memory: the unit never holds its full parameters, their gradients and the packed
        gradient at once. Skipped when frozen parameters share the buffer (their users may run
        later) or when it aliases the shards.
        """
        if not self.aliased and len(self.trainable) == len(self.params) and self.reshard_after_backward:
            self.reshard()

    def install_full_params(self) -> None:
        for sp, full in zip(self.params, self.full_params()):
            sp.install_full(full)

    def uninstall_full_params(self) -> None:
        for sp in self.params:
            sp.uninstall_full()

    def reshard(self) -> None:
        """Free the full parameters (a no-op for the buffer when it aliases the shards), and
        what a reshard to a smaller group kept."""
        partial_reshard.drop_partial(self)
        if self.shard_state is ShardState.SHARDED:
            return
        if self._pending_gather is not None:
            self.wait_unshard()
        self.uninstall_full_params()
        if self.on_reshard is not None:
            self.on_reshard(self)
        if self.aliased or self.shard_numel == 0:
            GATHERED.remove(0)
        else:
            self._free_full()
            GATHERED.remove(self.full_nbytes)
        self.shard_state = ShardState.SHARDED

    def write_back(self, full: list[torch.Tensor]) -> None:
        """Copy this rank's rows of each full tensor (shapes ``orig_shape``) into the shards."""
        with torch.no_grad():
            for sp, value in zip(self.params, full):
                self._local_view(sp).copy_(sp.spec.local_slice(value))

    # ---------------------------------------------------------------- gradients (see _reduce)
    def pack_grads(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The trainable parameters' full gradients packed rank-major, (N*S_t,): :func:`_reduce.pack_grads`."""
        return reduce.pack_grads(self, grads)

    def reduce_grads(self) -> None:
        """Launch the reduce-scatter of the accumulated full gradient: :func:`_reduce.reduce_grads`."""
        reduce.reduce_grads(self)

    def finish_reduce(self) -> None:
        """Wait for the pending reduction; the shards' ``.grad`` get it: :func:`_reduce.finish_reduce`."""
        reduce.finish_reduce(self)

    @property
    def has_pending_reduce(self) -> bool:
        return self._pending_reduce is not None

    def _grad_accumulated(self, full_flat: torch.Tensor) -> None:
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)


def _weak_hook(unit: Unit) -> Callable[[torch.Tensor], None]:
    """``unit``'s gradient-ready hook, holding the unit only weakly."""
    ref = weakref.ref(unit)

    def hook(full_flat: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            target._grad_accumulated(full_flat)

    return hook


class _SplitFull(torch.autograd.Function):
    """Split a unit's full flat buffer into its trainable parameters; gradients come back packed.

    Forward: views of the param-major full flat buffer, one per trainable parameter, shapes
    ``orig_shape`` (no copy). Backward: one copy of the parameters' gradients into a rank-major
    buffer (:meth:`Unit.pack_grads`), which becomes the flat buffer's ``.grad``; autograd's own
    split would concatenate param-major and need a second copy before the reduce-scatter.
    """

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, unit: Unit) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        unit._open_splits.add(ctx)
        pieces = flat.split(unit._full_splits[0])
        return tuple(pieces[2 * i].view(sp.spec.orig_shape) for i, sp in enumerate(unit.trainable))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        unit: Unit = ctx.unit
        unit._open_splits.discard(ctx)
        if all(g is None for g in grads):
            return None, None
        if not unit._open_splits:  # no later backward reads the full parameters
            unit.reshard_for_packing()
        return unit.pack_grads(grads), None
