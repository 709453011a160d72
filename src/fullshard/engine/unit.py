"""FSDP unit: the parameters one wrapped module owns, gathered and reduced together.

:class:`Unit` is a :class:`~fullshard.engine.layout.UnitLayout` (the sharded parameters in
their flat buffers; the vocabulary is defined there) that moves them: ``unshard`` all-gathers
the full parameters into the full flat buffer (async), ``reshard`` frees them, and the
gradients go back through its :class:`~fullshard.engine.reduce.GradReducer`. States:
:class:`ShardState` (SHARDED, UNSHARDED) and :class:`TrainingState` (set by the hooks).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fullshard import compat, probes
from fullshard.comm import buffers, collectives, flight_recorder, quantized
from fullshard.engine import custom_comm, reshard_guard, shard_sync
from fullshard.engine.grad_pack import pack_grads
from fullshard.engine.layout import ParamEntry, UnitLayout, real_views
from fullshard.engine.post_forward_shard import PostForwardShard
from fullshard.engine.reduce import GradReducer
from fullshard.engine.sharded_param import ShardedParam
from fullshard.engine.split_full import SplitFull, named_split
from fullshard.engine.unit_config import ShardState, TrainingState, UnitConfig

__all__ = ["ParamEntry", "ShardState", "TrainingState", "Unit", "UnitConfig"]

# On gloo (exact), a run's own rows go from the shards straight to the full buffer while the
# other ranks' rows are on the wire, and only theirs are copied out of the all-gather's scratch
# (False: the own rows too, as before; kept to measure the difference, tools/interleave.py).
OWN_ROWS_DIRECT = True


class Unit(UnitLayout):
    """The sharded parameters of one FSDP unit and the collectives that move them.

    Args: as :class:`~fullshard.engine.layout.UnitLayout`.

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
        super().__init__(name, params, shard_group, replicate_group, config)
        self.reshard_after_forward = config.reshard_after_forward
        # fully_shard's reshard_after_forward=None (torch's "auto"): as the root, keep the full
        # parameters from forward into backward whatever reshard_after_forward says; an explicit
        # value (or set_reshard_after_forward) is honoured by the root too, as in torch >= 2.8.
        self.auto_reshard_after_forward = False
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self.grads = GradReducer(self)
        self._pending_gather: collectives.Handle | None = None
        self._pooled_full: torch.Tensor | None = None  # while gathered from the pool: holds the empty storage
        # While the full flat buffer's memory is freed: its aliases' version counters before the
        # bump that makes autograd refuse saved views of it (see _mark_full_freed).
        self._clean_versions: tuple[int, int] | None = None
        self._split_fn: type[SplitFull] | None = None  # SplitFull named after this unit
        # The contexts of this unit's SplitFull nodes that autograd may still run backward on.
        self._open_splits: weakref.WeakSet[Any] = weakref.WeakSet()
        self.sync_grads = True  # False: gradients accumulate unsharded, no reduction (no_sync)
        self.reshard_after_backward = True  # False: stay gathered after backward (FSDP2's setter)
        # reshard_after_forward=M: this rank's 1/M of the full parameters, kept until backward.
        self.post_forward_shard: PostForwardShard | None = None
        self.on_reshard: Any = None  # called with the unit after each reshard (e.g. register shards again)
        self.backward_range: Any = None  # the open torch.profiler range of this unit's backward
        self.custom_all_gather: Any = None  # FSDPModule.set_custom_all_gather's comm (see custom_comm)
        # The shards' version the last all-gather read, if recorded (see engine.gather_reuse).
        self.records_gathered_version = False
        self.gathered_version: int | None = None
        reshard_guard.install()

    def set_post_forward_group(self, group: collectives.ProcessGroup) -> None:
        """Reshard to ``group`` (M consecutive ranks of the shard group) after forward."""
        self.post_forward_shard = PostForwardShard(self, group)

    def drop_post_forward_group(self) -> None:
        """Reshard fully after forward from now on (a ``reshard_after_forward=M`` unit whose
        setting was replaced); what it kept, if called between forward and backward, is freed and
        backward gathers from the shards instead."""
        if self.post_forward_shard is not None:
            self.post_forward_shard.drop()
            self.post_forward_shard = None

    def relayout_refusal(self) -> str | None:
        why = super().relayout_refusal()
        if why is not None:
            return why
        if self._open_splits and self._backward_reads_layout():
            return (
                " between this unit's forward and its backward: change requires_grad before forward or after "
                "backward, as with torch's fully_shard"
            )
        if self.grads.holds_unreduced or self.grads.partial_sum is not None:
            return (
                " while gradients accumulated without a reduction wait for one (no_sync(), set_requires_gradient_"
                "sync(False), set_requires_all_reduce(False)): change it after the backward that reduces them"
            )
        return None

    def _backward_reads_layout(self) -> bool:
        """Whether a backward is running that may read this unit's layout (its own, or any: a
        prefetch from another unit's backward)."""
        return self.training_state is TrainingState.PRE_BACKWARD or compat.in_backward()

    def defer_relayout(self, flipped: list[ShardedParam]) -> bool:
        """Parameters frozen while gradients accumulated with sync off wait for a reduction
        (torch's FSDP2 reduces what such a parameter accumulated with the rest): keep the layout
        until that reduction, and give them no gradient meanwhile (:meth:`full_params` hands
        them out detached). Their slots keep what they accumulated, reduced with the others'.
        Returns whether the change waits; an unfreeze never does (it has no slot to accumulate
        into: refused), nor a change between a unit's forward and its backward, nor one in a unit
        of the FSDP1 wrapper or whose layout is fixed (:meth:`layout_fixed`): refused at once. A reduction in
        flight still reads the old layout (a backward prefetch may gather the unit before it
        ends, under reentrant activation checkpointing): the freeze waits for it too."""
        grads = self.grads
        if self.layout_fixed() is not None or self.config.keep_param_objects:
            return False  # the FSDP1 wrapper refuses it at once (not compared with torch's FSDP1 there)
        if not (grads.holds_unreduced or grads.partial_sum is not None or grads.has_pending):
            return False
        if any(sp.shard is None or sp.shard.requires_grad for sp in flipped):
            return False
        index = {id(sp): i for i, sp in enumerate(self.trainable)}
        pending = sorted(index[id(sp)] for sp in flipped)
        if self._open_splits and self._backward_reads_layout() and pending != self.frozen_pending:
            return False  # changed since this backward's forward
        self.frozen_pending = pending
        return True

    def relayout_trainable(self) -> None:
        """See :meth:`UnitLayout.relayout_trainable`. A forward whose graph is still alive (its
        output kept, never backwarded) may have read the old full buffers: backward through it
        is refused from now on, with an error naming the unit (torch's lets the program drop it)."""
        old = (self.full_flat, self.frozen_full)
        clean = self._clean_versions or tuple(compat.version_counter(t) for t in old)
        stale = list(self._open_splits)
        super().relayout_trainable()
        if self.aliased or self.shard_numel == 0:
            self._clean_versions = None
        else:
            self._mark_full_freed()  # the new full buffers, as empty as the old ones were
            # Also for a graph that holds frozen parameters only (no split tracks those).
            reshard_guard.mark_stale(self, old, clean, stale)
        for ctx in stale:
            ctx.stale = True
        self._open_splits = weakref.WeakSet()
        if self.on_relayout is not None:
            self.on_relayout()

    # ---------------------------------------------------------------- all-gather
    def _check_state(self, expected: TrainingState | tuple[TrainingState, ...], action: str) -> None:
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if self.training_state not in allowed:
            names = " or ".join(s.name for s in allowed)
            raise RuntimeError(
                f"FSDP unit {self.name!r}: cannot {action} in training state "
                f"{self.training_state.name}, expected {names}"
            )

    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather that materializes the full parameters."""
        phase = _PHASES.get(self.training_state)  # None (a prefetch): the caller's label stands
        with flight_recorder.at(self.name, phase):
            self._unshard(async_op)

    def _unshard(self, async_op: bool) -> None:
        if self.shard_state is ShardState.UNSHARDED or self._pending_gather is not None:
            if self._pending_gather is None and (
                self.frozen_pending is not None or shard_sync.requires_grad_changed(self)
            ):
                self._relayout_kept()
            elif not async_op:
                self.wait_for_unshard()
            return
        shard_sync.sync_shards(self)
        self.gathered_version = shard_sync.shards_version(self) if self.records_gathered_version else None
        if self.aliased or self.shard_numel == 0:
            self.shard_state = ShardState.UNSHARDED
            if probes.ACTIVE is not None:
                probes.ACTIVE.gathered.add(0)
            return
        if probes.ACTIVE is not None:
            probes.record_event("unshard", self.name)
            probes.ACTIVE.gathered.add(self.full_nbytes)
        self._allocate_full()
        shard = self.post_forward_shard
        if shard is not None and shard.kept is not None:  # resharded to a smaller group after forward
            self.gathered_version = None  # from what forward kept, not from the shards now
            self._pending_gather = shard.gather(self.custom_all_gather, async_op)
            if not async_op:
                self.wait_for_unshard()
            return
        if self.shard_size == 1:
            self.full_data.copy_(self.local_flat, non_blocking=True)  # cast and/or upload
            self._mark_full_valid()
            self.shard_state = ShardState.UNSHARDED
            return
        quant = self.config.comm_quantization
        if self.custom_all_gather is not None:
            self._pending_gather = custom_comm.gather(self, self.custom_all_gather, async_op)
        elif quant is not None and quant.params is not None:
            # The shards themselves are quantized (no cast first); dequantized in the compute dtype.
            local = self.local_flat.to(self.device, non_blocking=True)
            self._pending_gather = self._gather_into(self.full_data, local, quant.block_size)
        else:
            self._pending_gather = self._gather_into(self.full_data, self.local_flat)
        if not async_op:
            self.wait_for_unshard()

    def _relayout_kept(self) -> None:
        """Lay out again a unit kept gathered (``set_reshard_after_backward(False)``, whose next
        unshard skips :func:`~.shard_sync.sync_shards`) whose parameters' ``requires_grad``
        changed, keeping the full values it holds: torch's kept unsharded parameters stay as
        they are until their next all-gather, also after an optimizer step. A freeze may wait
        (:meth:`defer_relayout`), the unit staying as it is."""
        flipped = shard_sync.flipped_params(self)
        if not flipped:
            self.frozen_pending = None  # unfrozen again before the reduction
            return
        if self.defer_relayout(flipped):
            return
        shard_sync.check_relayout(self, flipped)  # before anything changes
        with torch.no_grad():
            kept = {id(sp): full.clone() for sp, full in zip(self.params, self.full_params(tracked=False))}
        self.reshard()
        self._unshard(async_op=False)  # sync_shards lays it out again
        if self.aliased or self.shard_numel == 0:
            return  # the full parameters are the shards
        with torch.no_grad():
            for sp, full in zip(self.params, self.full_params(tracked=False)):
                full.copy_(kept[id(sp)])
        self.gathered_version = None  # the values kept, not the shards'

    def _allocate_full(self) -> None:
        """Give the full flat buffer's storage its memory (reused memory on CPU, see ``comm.buffers``)."""
        data = self.full_data
        self.grads.reclaim()  # the last step's packed gradient, when its gradient shards are gone
        self._pooled_full = buffers.acquire_storage(data.untyped_storage(), data.numel(), data.dtype, self.device)

    def _free_full(self) -> None:
        """Take the full flat buffer's memory away again (0 bytes; a no-op when already freed)."""
        buffers.release_storage(self.full_data.untyped_storage(), self._pooled_full)
        self._pooled_full = None

    def _mark_full_freed(self) -> None:
        """Make autograd refuse the full parameters while their memory is away: a backward that
        would read a tensor saved from them raises an error naming this unit (see
        :mod:`~fullshard.engine.reshard_guard`), instead of reading freed memory."""
        reshard_guard.mark_freed(self)

    def _mark_full_valid(self) -> None:
        reshard_guard.mark_valid(self)

    def _gather_into(
        self, full: torch.Tensor, local: torch.Tensor, int8_block: int | None = None
    ) -> collectives.Handle:
        """Start all-gathering ``local`` (S,) of every rank into the param-major ``full`` (N*S,).

        Each piece of :attr:`_pieces` is one all-gather: a lone parameter lands in its own
        region of ``full`` directly (its N padded shards back to back are its padded full
        tensor); a run of parameters lands rank-major in a scratch buffer from :data:`buffers.POOL`
        (the next unit of the same size reuses it: no fresh pages to fault in) and is copied out;
        on gloo (exact) only the other ranks' rows are: ours go straight from ``local`` to
        ``full`` while theirs are on the wire (:data:`OWN_ROWS_DIRECT`). A lone parameter sharded
        along a dim > 0 goes through a scratch buffer like a run: the copy-out rearranges it
        into its full tensor (:meth:`~fullshard.engine.layout.UnitLayout.copy_out_ranked`).
        ``local`` may differ from ``full`` in dtype or device (the shards in the parameter
        dtype under mixed precision; on the host under CPU offload): each piece's own slot of
        the output is then cast (or uploaded) into and sent from, so no converted copy of the
        shards is made. ``int8_block``: all-gather int8 blocks of this many elements instead
        (:func:`~fullshard.comm.quantized.all_gather_int8`, each parameter's shard its own
        segment): ``local`` is then quantized from its own dtype and dequantized into ``full``'s.
        """
        n, me = self.shard_size, self.rank
        handles: list[collectives.Handle] = []
        copy_outs: list[tuple[torch.Tensor, int]] = []
        own_direct = OWN_ROWS_DIRECT and int8_block is None and collectives.backend(self.shard_group) == "gloo"
        for k, (group, start, length) in enumerate(self._pieces):
            src = local[start : start + length]
            scratch = len(group) > 1 or self._run_dims[k]
            if not scratch:
                sp = group[0]
                out = full[sp.full_offset : sp.full_offset + sp.spec.padded_numel]
            else:
                out = buffers.POOL.acquire(n * length, full.dtype, full.device)
                copy_outs.append((out, k))
            if int8_block is None and (src.dtype != full.dtype or src.device != full.device):
                # Cast (or upload) our shards straight into our own slot of the output and send
                # them from there: no compute-dtype copy of the shards beside the gathered buffer
                # (it would live as long as the gather is in flight, a prefetch's included).
                own = out.view(n, -1)[me]
                own.copy_(src, non_blocking=True)
                src = own
            if int8_block is None:
                h = collectives.all_gather(
                    out, src, self.shard_group, async_op=True, fill_own=not (own_direct and scratch)
                )
            else:
                segments = self._run_sizes[k]
                h = quantized.all_gather_int8(out, src, self.shard_group, int8_block, True, segments)
            assert h is not None
            handles.append(h)
            if own_direct and scratch:
                outs = self._copy_out_targets(full, k)
                self.copy_out_ranked(src.view(1, -1), group, self._run_sizes[k], outs, me, self._run_dims[k])
        # The rows still to copy out of each run's rank-major scratch: all, or all but ours.
        rows = [(0, n)] if not own_direct else [(a, b) for a, b in ((0, me), (me + 1, n)) if b > a]

        def epilogue() -> None:
            for gathered, k in copy_outs:
                outs = self._copy_out_targets(full, k)
                ranked = gathered.view(n, -1)
                for a, b in rows:
                    self.copy_out_ranked(
                        ranked[a:b], self._pieces[k][0], self._run_sizes[k], outs, a, self._run_dims[k]
                    )
                buffers.POOL.release(gathered)

        return collectives.Handle(handles, epilogue if copy_outs else None)

    def _copy_out_targets(self, full: torch.Tensor, k: int) -> list[torch.Tensor]:
        """Run piece ``k``'s parameters in ``full``, each viewed (N, padded shard numel)."""
        if full is self.full_data:  # the usual case: views built once at construction
            return self._run_targets[k]
        n = self.shard_size
        return [full[sp.full_offset : sp.full_offset + sp.spec.padded_numel].view(n, -1) for sp in self._pieces[k][0]]

    def gather_full(self, local: torch.Tensor) -> list[torch.Tensor]:
        """All-gather a buffer laid out like the local flat buffer, in its own dtype (collective).

        Args:
            local: shape (S,), any dtype and device; typically the shards or their gradients.

        Returns:
            one fresh tensor per parameter, shape ``orig_shape``, on the compute device. The
            unit's own buffers and state are untouched.
        """
        src = local.to(self.device)
        if self.shard_size == 1 or self.shard_numel == 0:
            full = src.clone()
        else:
            full = torch.empty(self.shard_size * self.shard_numel, dtype=src.dtype, device=src.device)
            with flight_recorder.at(self.name):
                self._gather_into(full, src).wait()
        return [full[sp.full_offset : sp.full_offset + sp.spec.numel].view(sp.spec.orig_shape) for sp in self.params]

    def local_grads(self) -> torch.Tensor:
        """The shards' gradients packed like the local flat buffer (zeros where None), (S,)."""
        flat = torch.zeros_like(self.local_flat)
        for sp in self.params:
            grad = sp.local_grad()
            if grad is not None:
                self.local_view(sp, flat).copy_(grad)
        return flat

    def wait_for_unshard(self) -> None:
        """Finish a pending all-gather (FSDP2's name); the full flat buffer then holds the full parameters."""
        if self._pending_gather is not None:
            self._pending_gather.wait()
            self._pending_gather = None
        if self.shard_state is ShardState.SHARDED and not (self.aliased or self.shard_numel == 0):
            self._mark_full_valid()
        self.shard_state = ShardState.UNSHARDED

    def full_params(self, tracked: bool = True) -> list[torch.Tensor]:
        """Per-parameter full tensors (shape ``orig_shape``), views of the full flat buffer.

        Under grad mode the trainable ones come from :class:`~.split_full.SplitFull`, so their gradients
        accumulate into the full flat buffer's ``.grad``, laid out rank-major (the
        reduce-scatter's input as it stands). ``tracked=False``: views whose backward is not
        expected to run (a recomputation's), so they do not hold off
        :meth:`reshard_for_packing`. Call only while UNSHARDED.
        """
        if self.shard_state is not ShardState.UNSHARDED:
            raise RuntimeError(f"FSDP unit {self.name!r}: full parameters requested while SHARDED")
        views: list[torch.Tensor] = []
        groups = (self.trainable, self.params[len(self.trainable) :])
        for flat, group, sizes in zip((self.full_flat, self.frozen_full), groups, self._full_splits):
            if not group:
                continue
            if flat.requires_grad and torch.is_grad_enabled():
                split = list(self._named_split().apply(flat, self, tracked))
                for i in self.frozen_pending or ():
                    split[i] = split[i].detach()  # frozen, its change deferred (defer_relayout)
                views += split
            else:
                views += real_views(flat, sizes, [sp.spec.orig_shape for sp in group])
        return views

    def _named_split(self) -> type[SplitFull]:
        """:class:`~.split_full.SplitFull` under a name that says which unit's full parameters
        its outputs are, so autograd's errors about them (a use after reshard) name the unit."""
        fn = self._split_fn
        if fn is None or fn._unit_name != self.name:
            fn = self._split_fn = named_split(self.name)
        return fn

    def reshard_for_packing(self) -> None:
        """Reshard now that autograd has no more use for the full parameters (the last of the
        unit's split nodes is running its backward), so the packed gradient can take their
        memory: the unit never holds its full parameters, their gradients and the packed
        gradient at once. Skipped when frozen parameters share the buffer (their users may run
        later) or when it aliases the shards.
        """
        if not self.aliased and len(self.trainable) == len(self.params) and self.reshard_after_backward:
            self.reshard()

    def install_full_params(self, for_recompute: bool = False) -> None:
        """Make the modules' attributes resolve to the full parameters.

        ``for_recompute`` (the pre-backward hook, where autograd has grad mode off): the trainable
        ones require grad as in forward, from an untracked :class:`~.split_full.SplitFull`. Activation
        checkpointing applied before ``fully_shard`` recomputes the forward on them and must save
        the same tensors as the original forward did; a weight that does not require grad saves
        fewer. Backward runs on the original graph, so nothing flows back through these.
        """
        if for_recompute:
            with torch.enable_grad():
                fulls = self.full_params(tracked=False)
        else:
            fulls = self.full_params()
        for sp, full in zip(self.params, fulls):
            sp.install_full(full)

    def uninstall_full_params(self) -> None:
        for sp in self.params:
            sp.uninstall_full()

    def reshard(self) -> None:
        """Free the full parameters (a no-op for the buffer when it aliases the shards), and
        what a reshard to a smaller group kept."""
        if self.post_forward_shard is not None:
            self.post_forward_shard.drop()
        if self._pending_gather is not None:
            # A prefetch whose unit did not run (a branch skipped it, its output went unused):
            # finish it (the other ranks sent their part) and drop what it gathered, which the
            # optimizer step would make stale before the unit's next forward.
            self.wait_for_unshard()
        if self.shard_state is ShardState.SHARDED:
            return
        self.uninstall_full_params()
        if self.on_reshard is not None:
            self.on_reshard(self)
        if not (self.aliased or self.shard_numel == 0):
            self._free_full()
            self._mark_full_freed()
        if probes.ACTIVE is not None:
            probes.ACTIVE.gathered.remove(0 if self.aliased or self.shard_numel == 0 else self.full_nbytes)
        self.shard_state = ShardState.SHARDED

    def reshard_post_forward(self) -> None:
        """After forward under ``reshard_after_forward=M``: keep this rank's 1/M of the full
        parameters for backward's smaller all-gather, then reshard. Call while UNSHARDED."""
        assert self.post_forward_shard is not None, "reshard_post_forward without set_post_forward_group"
        kept = self.post_forward_shard.copy_mine()
        self.reshard()
        self.post_forward_shard.hold(kept)

    def write_back(self, full: list[torch.Tensor]) -> None:
        """Copy this rank's rows of each full tensor (shapes ``orig_shape``) into the shards."""
        with torch.no_grad():
            for sp, value in zip(self.params, full):
                self.local_view(sp).copy_(sp.spec.local_slice(value))

    # ---------------------------------------------------------------- gradients (see reduce)
    def pack_grads(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The trainable parameters' full gradients packed rank-major, (N*S_t,): :func:`.grad_pack.pack_grads`."""
        self.grads.reclaim()
        return pack_grads(self, grads)

    def reduce_grads(self) -> None:
        """Launch the reduce-scatter of the accumulated full gradient: :meth:`GradReducer.launch`."""
        with flight_recorder.at(self.name, "post-backward reduce-scatter"):
            self.grads.launch()

    def finish_reduce(self) -> None:
        """Wait for the pending reduction; the shards' ``.grad`` get it: :meth:`GradReducer.finish`."""
        self.grads.finish()

    @property
    def has_pending_gather(self) -> bool:
        """Whether an all-gather was started (a prefetch) and not yet waited on."""
        return self._pending_gather is not None

    @property
    def has_pending_reduce(self) -> bool:
        return self.grads.has_pending


_PHASES = {TrainingState.FORWARD: "forward", TrainingState.PRE_BACKWARD: "backward"}
