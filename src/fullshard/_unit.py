"""FSDP unit: the parameters one wrapped module owns, gathered and reduced together.

A unit keeps two flat buffers (see ``_sharded_param`` for the vocabulary):

- the **local flat buffer**, shape (S,), S = sum of the padded shard sizes: this rank's shards
  back to back, each padded to its padded shard size. The registered shard parameters are views
  into it, so it is the all-gather input as it stands.
- the **full flat buffer**, shape (N*S,), padded full parameters back to back (param-major). It
  is an autograd leaf: each forward takes per-parameter views of it, so the gradients of all the
  unit's parameters accumulate into one flat gradient, and a single post-accumulate-grad hook
  says when the unit's gradient is complete. Its storage is freed (resized to 0) while the unit
  is SHARDED; autograd's saved views keep pointing at it and see the data again after the next
  unshard refills it.

The all-gather output is rank-major (N, S); the copy-out to the param-major full buffer is one
``split_with_sizes_copy``. A unit with one parameter (or a group of one rank) needs no copy.
The gradient goes the other way: param-major (N*S,) -> rank-major send buffer -> reduce-scatter
-> (S,) local gradient buffer whose views become the shards' ``.grad``.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import torch
from torch import nn

from fullshard import _collectives as C
from fullshard._sharded_param import ParamSlot, ShardedParam, ShardSpec


class ShardState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


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
        shard_group: process group the parameters are sharded over (N ranks).
        replicate_group: optional group over which gradients are all-reduced after the
            reduce-scatter (NO_SHARD uses a shard group of one rank and the world here).
        reshard_after_forward: free the full parameters after forward (FULL_SHARD).

    Raises:
        ValueError: parameters of different dtypes or devices in one unit.
    """

    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter, list[ParamSlot]]],
        shard_group: Optional[C.ProcessGroup],
        replicate_group: Optional[C.ProcessGroup],
        reshard_after_forward: bool,
    ) -> None:
        self.name = name
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.world = C.group_size(shard_group) if shard_group is not None else 1
        self.rank = C.group_rank(shard_group) if shard_group is not None else 0
        self.replicas = C.group_size(replicate_group) if replicate_group is not None else 1
        self.reshard_after_forward = reshard_after_forward
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self.params: list[ShardedParam] = []
        self.dtype, self.device = self._common_dtype_device(params)
        self._build(params)
        self._pending_gather: Optional[C.Handle] = None
        self._pending_reduce: Optional[tuple[_Multi, torch.Tensor, torch.Tensor]] = None
        self.on_grad_ready: Optional[Callable[["Unit"], None]] = None

    # ---------------------------------------------------------------- construction
    def _common_dtype_device(
        self, params: list[tuple[str, nn.Parameter, list[ParamSlot]]]
    ) -> tuple[torch.dtype, torch.device]:
        if not params:
            return torch.float32, torch.device("cpu")
        kinds = {(p.dtype, p.device) for _, p, _ in params}
        if len(kinds) > 1:
            listing = ", ".join(f"{fqn}: {p.dtype} on {p.device}" for fqn, p, _ in params)
            raise ValueError(
                f"FSDP unit {self.name!r} holds parameters of several dtypes or devices "
                f"({listing}); move the module to one device and dtype before wrapping "
                "(module.to(device, dtype)), or wrap the differing submodules as their own units"
            )
        dtype, device = kinds.pop()
        return dtype, device

    def _build(self, params: list[tuple[str, nn.Parameter, list[ParamSlot]]]) -> None:
        local_off = full_off = 0
        for fqn, p, slots in params:
            spec = ShardSpec(p.shape, self.world, self.rank)
            sp = ShardedParam(spec, slots, fqn, p.requires_grad)
            sp.local_offset, sp.full_offset = local_off, full_off
            local_off += spec.padded_shard_numel
            full_off += spec.padded_numel
            self.params.append(sp)
        self.shard_numel = local_off  # S
        self.local_flat = torch.zeros(local_off, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for (_, p, _), sp in zip(params, self.params):
                view = self._local_view(sp)
                view.copy_(sp.spec.local_slice(p.detach()))
                sp.register_shard(nn.Parameter(view, requires_grad=p.requires_grad))
        if self.world == 1:
            full = _alias(self.local_flat)
        else:
            full = torch.empty(self.world * local_off, dtype=self.dtype, device=self.device)
        self._full_data = _alias(full)  # writes here leave autograd's version counter alone
        if self.world > 1:
            full.untyped_storage().resize_(0)
        self.full_flat = full.requires_grad_(any(sp.requires_grad for sp in self.params))
        if self.full_flat.requires_grad:
            self.full_flat.register_post_accumulate_grad_hook(self._grad_accumulated)

    def _local_view(self, sp: ShardedParam) -> torch.Tensor:
        n = sp.spec.local_numel
        return self.local_flat[sp.local_offset : sp.local_offset + n].view(sp.spec.local_shape)

    @property
    def full_nbytes(self) -> int:
        return self.world * self.shard_numel * self.full_flat.element_size()

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

    def _sync_shards(self) -> None:
        """Copy back any shard whose storage was replaced (``param.data = ...``)."""
        for sp in self.params:
            assert sp.shard is not None
            view = self._local_view(sp)
            if sp.shard.data_ptr() != view.data_ptr() and sp.spec.local_numel > 0:
                with torch.no_grad():
                    view.copy_(sp.shard.detach().reshape(view.shape))
                    sp.shard.data = view

    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather that materializes the full parameters."""
        if self.shard_state is ShardState.UNSHARDED or self._pending_gather is not None:
            if not async_op:
                self.wait_unshard()
            return
        if self.world == 1 or self.shard_numel == 0:
            self.shard_state = ShardState.UNSHARDED
            GATHERED.add(0)
            return
        self._sync_shards()
        storage = self._full_data.untyped_storage()
        storage.resize_(self.full_nbytes)
        direct = len(self.params) == 1
        out = self._full_data if direct else torch.empty_like(self._full_data)
        handle = C.all_gather(out, self.local_flat, self.shard_group, async_op=True)
        assert handle is not None

        def copy_out() -> None:
            if not direct:
                self._copy_out(out)

        self._pending_gather = C.Handle(handle, copy_out)
        GATHERED.add(self.full_nbytes)
        if not async_op:
            self.wait_unshard()

    def _copy_out(self, gathered: torch.Tensor) -> None:
        n, s = self.world, self.shard_numel
        sizes = [sp.spec.padded_shard_numel for sp in self.params]
        outs = [
            self._full_data[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(n, -1)
            for sp in self.params
        ]
        torch.split_with_sizes_copy(gathered.view(n, s), sizes, dim=1, out=outs)

    def wait_unshard(self) -> None:
        """Finish a pending all-gather; the full flat buffer then holds the full parameters."""
        if self._pending_gather is not None:
            self._pending_gather.wait()
            self._pending_gather = None
        self.shard_state = ShardState.UNSHARDED

    def full_params(self) -> list[torch.Tensor]:
        """Per-parameter full tensors (shape ``orig_shape``), views of the full flat buffer.

        Under grad mode they are autograd views of one split, so their gradients accumulate
        into the full flat buffer's ``.grad``. Call only while UNSHARDED.
        """
        if self.shard_state is not ShardState.UNSHARDED:
            raise RuntimeError(f"FSDP unit {self.name!r}: full parameters requested while SHARDED")
        sizes: list[int] = []
        for sp in self.params:
            sizes += [sp.spec.numel, sp.spec.padded_numel - sp.spec.numel]
        pieces = self.full_flat.split(sizes)
        views = []
        for i, sp in enumerate(self.params):
            piece = pieces[2 * i].view(sp.spec.orig_shape)
            views.append(piece if sp.requires_grad else piece.detach())
        return views

    def install_full_params(self) -> None:
        for sp, full in zip(self.params, self.full_params()):
            sp.install_full(full)

    def uninstall_full_params(self) -> None:
        for sp in self.params:
            sp.uninstall_full()

    def reshard(self) -> None:
        """Free the full parameters (no-op for a group of one rank)."""
        if self.shard_state is ShardState.SHARDED:
            return
        if self._pending_gather is not None:
            self.wait_unshard()
        self.uninstall_full_params()
        if self.world > 1 and self.shard_numel > 0:
            self._full_data.untyped_storage().resize_(0)
            GATHERED.remove(self.full_nbytes)
        else:
            GATHERED.remove(0)
        self.shard_state = ShardState.SHARDED

    # ---------------------------------------------------------------- gradients
    def _grad_accumulated(self, full_flat: torch.Tensor) -> None:
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)

    def reduce_grads(self) -> None:
        """Launch the reduce-scatter (and replica all-reduce) of the accumulated full gradient."""
        grad = self.full_flat.grad
        if grad is None:
            return
        self.full_flat.grad = None
        if self.world == 1:
            out = grad
        else:
            out = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
        send = grad if (self.world == 1 or len(self.params) == 1) else self._to_rank_major(grad)
        handles: list[C.Handle] = []
        if self.world > 1:
            h = C.reduce_scatter(out, send, self.shard_group, average=True, async_op=True)
            assert h is not None
            handles.append(h)
        if self.replicas > 1:
            # A replica all-reduce has to follow the reduce-scatter's local epilogue.
            for h in handles:
                h.wait()
            h2 = C.all_reduce(out, self.replicate_group, average=True, async_op=True)
            assert h2 is not None
            handles.append(h2)
        self._pending_reduce = (_Multi(handles), out, send)

    def _to_rank_major(self, grad: torch.Tensor) -> torch.Tensor:
        n = self.world
        parts = [
            grad[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(n, -1)
            for sp in self.params
        ]
        return torch.cat(parts, dim=1).view(-1)

    def finish_reduce(self) -> None:
        """Wait for the pending reduction and add the result to the shards' ``.grad``."""
        if self._pending_reduce is None:
            return
        handle, out, _send = self._pending_reduce
        handle.wait()
        self._pending_reduce = None
        for sp in self.params:
            if not sp.requires_grad:
                continue
            assert sp.shard is not None
            n = sp.spec.local_numel
            g = out[sp.local_offset : sp.local_offset + n].view(sp.spec.local_shape)
            if sp.shard.grad is None:
                sp.shard.grad = g
            else:
                sp.shard.grad.add_(g)

    @property
    def has_pending_reduce(self) -> bool:
        return self._pending_reduce is not None


class _Multi:
    """Waits on several handles in order."""

    def __init__(self, handles: list[C.Handle]) -> None:
        self._handles = handles

    def wait(self) -> None:
        for h in self._handles:
            h.wait()
