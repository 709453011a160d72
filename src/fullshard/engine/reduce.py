"""The gradient side of an FSDP unit: pack, reduce-scatter, hand the shards their gradients.

Per-parameter gradients -> one packing copy, rank-major (N*S_t,), into pooled memory
(:mod:`.grad_pack`; the unit's full parameters were freed just before, see
``Unit.reshard_for_packing``) -> cast to the reduce
dtype -> reduce-scatter -> (S_t,) -> cast back (and copied to CPU under offload) -> views of it
become the shards' ``.grad``. Low-precision reductions divide before and after the sum so float16
cannot overflow. The vocabulary (S, S_t, padded shard) is :mod:`.layout`'s and :mod:`.sharded_param`'s.
Under ``CommQuantization(grads=...)`` the reduce-scatter sends bf16 or int8 blocks instead
(:func:`fullshard.comm.quantized.reduce_scatter_quantized`; the packed gradient is not cast first,
and the sum is float32, so nothing is divided before it).

:class:`GradReducer` owns a unit's gradient state between backward and the optimizer: the
reduction in flight, the last output buffer (reused on CPU), the host gradient buffer under
offload, and the partial sum kept while the replica all-reduce is off (a partial reduce).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from fullshard import compat, probes
from fullshard.comm import buffers, collectives, quantized
from fullshard.comm.collectives import predivide_factor
from fullshard.engine import custom_comm
from fullshard.engine.grad_use import GradUse, unused_here
from fullshard.engine.layout import UnitLayout
from fullshard.engine.sharded_param import ShardedParam


@dataclasses.dataclass
class _Pending:
    """A reduction in flight: wait on ``handle``, then ``out`` (S_t,) holds this rank's shard."""

    handle: collectives.Handle
    out: torch.Tensor
    packed: torch.Tensor | None  # the packed input, given back to the pool when done
    partial_reduce: bool  # ``out`` is a partial sum to keep (the replica all-reduce is off)
    in_place: bool = False  # ``out`` is this rank's chunk of ``packed``
    used: list[bool] | None = None  # per trainable parameter: a gradient reached it (see note_used)


class GradReducer:
    """The gradient state of one unit, and the reductions that change it.

    Args:
        unit: the layout whose full flat buffer's ``.grad`` is reduced into its shards' ``.grad``.
    """

    def __init__(self, unit: UnitLayout) -> None:
        self.unit = unit
        self._pending: _Pending | None = None
        self._last_out: torch.Tensor | None = None  # on CPU: reused while nothing else holds it
        self._host_grad: torch.Tensor | None = None  # under offload: where gradients land on the host
        self._partial_sum: torch.Tensor | None = None  # reduce-scattered, not yet all-reduced
        # fully_shard (torch FSDP2's rule): gradients accumulated with sync off are kept in the
        # reduce dtype, not summed by autograd in the compute dtype (bf16 chunks add up in fp32).
        self.upcast_unsynced = False
        self._unsynced: torch.Tensor | None = None  # (N*S_t,) in the reduce dtype
        # The wrapper (torch FSDP1's use_orig_params): a zero_grad after a backward with sync off
        # drops what it accumulated. Per trainable shard: (shard, its .grad then, that grad's
        # version, whether the grad is a zero placeholder of ours); None when nothing is held.
        self.zero_grad_drops_unsynced = True
        # fully_shard (torch FSDP2's rule): a parameter no backward reached since the last
        # reduction keeps its ``.grad`` None (an optimizer then skips it), instead of a zero;
        # which got a gradient here (see grad_use).
        self.unused_grads_none = False
        self.use = GradUse(self._give_zero)
        # fully_shard's set_reduce_scatter_unused_params(True) (torch FSDP2's rule): a unit the
        # backward did not reach reduces zeros at its end, so its parameters get a .grad too.
        self.reduce_unreached = False
        # FullyShardedDataParallel.register_comm_hook: (state, hook) that reduces instead of
        # fullshard's collectives, as torch FSDP1's communication hooks do.
        self.comm_hook: tuple[object, Callable[..., None]] | None = None
        # FSDPModule.set_all_reduce_hook: called on each reduced shard (S_t,), in the reduce dtype.
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        # FSDPModule.set_custom_reduce_scatter: the user's comm (see custom_comm), and
        # set_force_sum_reduction_for_comms, which only changes the op that comm is given.
        self.custom_reduce_scatter: object | None = None
        self.force_sum = False
        self._marks: list[tuple[ShardedParam, torch.Tensor, int, bool]] | None = None
        # Set by the hooks for a unit whose full buffer's size no other unit of its tree has: its
        # gradient shards may stay in its own chunk of the packed gradient (see launch).
        self.in_place = False
        self._pinned: torch.Tensor | None = None  # the packed gradient the shards' .grad view
        self._own = 0  # which chunk of it is this rank's

    @property
    def has_pending(self) -> bool:
        """Whether a reduction was launched and not yet finished."""
        return self._pending is not None

    @property
    def holds_unreduced(self) -> bool:
        """Whether gradients accumulated since the last reduction wait for one (the full flat
        gradient, or the reduce-dtype sum kept while sync was off)."""
        return self.unit.full_flat.grad is not None or self._unsynced is not None

    @property
    def last_output(self) -> torch.Tensor | None:
        """The buffer the last reduce-scatter wrote (shape (S_t,)), kept for reuse on CPU (for a
        reduction made in place, this rank's chunk of the packed gradient holding the shards')."""
        if self._pinned is not None:
            return self._pinned.view(self.unit.shard_size, -1)[self._own]
        return self._last_out

    @property
    def holding_packed(self) -> torch.Tensor | None:
        """The packed gradient (N*S_t,) whose own chunk the shards' ``.grad`` view, or None."""
        return self._pinned

    def reclaim(self) -> None:
        """Give the packed gradient that held the shards' gradients back to the pool once nothing
        uses it any more (``zero_grad`` dropped them): the unit's next buffer of its size is it."""
        pinned = self._pinned
        if pinned is not None and buffers.sole_owner(pinned):
            self._pinned = None
            buffers.POOL.release(pinned)

    @property
    def partial_sum(self) -> torch.Tensor | None:
        """Sums reduce-scattered while the replica all-reduce was off (shape (S_t,)), or None."""
        return self._partial_sum

    def hold_unsynced(self) -> None:
        """Backward with gradient sync off: with ``upcast_unsynced``, move the full flat
        gradient into the reduce-dtype sum that the next reduction takes (a no-op when the
        compute dtype is the reduce dtype: autograd's own sum is the same). With
        ``zero_grad_drops_unsynced``, mark the shards' gradients (see :meth:`drop_if_zeroed`)."""
        if self.zero_grad_drops_unsynced and self._marks is None:
            self._marks = [self._mark(sp) for sp in self.unit.trainable]
        grad = self.unit.full_flat.grad
        if not self.upcast_unsynced or grad is None or grad.dtype == self.unit.reduce_dtype:
            return
        self.unit.full_flat.grad = None
        if self._unsynced is None:
            self._unsynced = grad.to(self.unit.reduce_dtype)
        else:
            self._unsynced.add_(grad)

    @staticmethod
    def _mark(sp: ShardedParam) -> tuple[ShardedParam, torch.Tensor, int, bool]:
        assert sp.shard is not None
        grad = sp.shard.grad
        if grad is not None:
            return sp, grad, compat.version_counter(grad), False
        placeholder = torch.zeros_like(sp.local)  # its own storage: a zero_() of another leaves it
        sp.set_grad(placeholder)
        grad = sp.shard.grad
        assert grad is not None
        return sp, grad, compat.version_counter(grad), True

    def drop_if_zeroed(self) -> None:
        """At the unit's next backward, or the reduction that takes the held gradient: drop the
        unsynced gradient of each shard whose ``.grad`` the user set to None, replaced, or zeroed
        in place since the backward that held it (``optimizer.zero_grad()``), as torch FSDP1 with
        ``use_orig_params`` does; take the zero placeholders away again (the reduced gradient
        becomes the ``.grad``). Not at a forward: a zero_grad after a forward that raised, or
        whose loss did, must still be seen."""
        marks, self._marks = self._marks, None
        if marks is None:
            return
        full = self.unit.full_flat.grad
        zeroed = []
        for sp, grad, version, placeholder in marks:
            assert sp.shard is not None
            now = sp.shard.grad
            if now is None or now is not grad or (compat.version_counter(now) != version and not bool(now.any())):
                zeroed.append(sp)
            if placeholder and now is grad:
                sp.shard.grad = None
        if full is None or not zeroed:
            return
        if len(zeroed) == len(marks):
            self.unit.full_flat.grad = None
            return
        rows = full.view(self.unit.shard_size, -1)  # packed rank-major (see pack_grads): (N, S_t)
        with torch.no_grad():
            for sp in zeroed:
                rows[:, sp.local_offset : sp.local_offset + sp.spec.padded_shard_numel].zero_()

    def note_used(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Record which trainable parameters got a gradient (``grads``: one per parameter, None
        where the forward did not use it) for :attr:`unused_grads_none`."""
        if self.unused_grads_none:
            self.use.note([g is not None for g in grads])

    def uses(self) -> list[GradUse]:
        """The use records of this unit's parts (:mod:`.grad_use`), which the settle sums."""
        return [self.use]

    def launch(self) -> None:
        """Launch the reduce-scatter (and replica all-reduce) of the accumulated full gradient,
        first landing this unit's reduction still in flight, if any (one launch replacing it would
        drop it)."""
        if self._pending is not None:
            self.finish()
        unit = self.unit
        self.drop_if_zeroed()  # a unit this backward did not reach, reducing what it held
        used = self.use.take()
        grad = unit.full_flat.grad
        unit.full_flat.grad = None
        if self._unsynced is not None:  # sums kept in the reduce dtype while sync was off
            held, self._unsynced = self._unsynced, None
            if grad is not None:
                held.add_(grad)
            grad = held
        if grad is None:
            return
        if self.unused_grads_none:
            self.use.launched(used, len(unit.trainable), unit.replicate_size == 1 or unit.all_reduce_grads)
        if probes.ACTIVE is not None:
            probes.record_event("reduce", unit.name)
        if self.custom_reduce_scatter is not None and unit.shard_size > 1:
            self._launch_custom(grad, used)
            return
        ranks = unit.shard_size * unit.replicate_size
        quant = unit.config.comm_quantization
        wire = quant.grads if quant is not None and unit.shard_size > 1 else None
        low = unit.reduce_dtype in (torch.float16, torch.bfloat16)
        # A quantized reduce-scatter sums in float32: no overflow to guard against by predividing.
        pre = predivide_factor(ranks) if low and unit.divide_factor is None and wire is None else 1
        if grad.dtype != unit.reduce_dtype and wire is None:
            grad = grad.to(unit.reduce_dtype)
        if self.comm_hook is not None:
            self._launch_hooked(grad, used)
            return
        if pre > 1:
            grad.div_(pre)
        post = (unit.divide_factor or ranks) / pre
        all_reduce = unit.replicate_size > 1 and unit.all_reduce_grads
        in_place = wire is None and self._reduces_in_place(grad)
        if in_place:
            self._own = collectives.group_rank(unit.shard_group)
            out = grad.view(unit.shard_size, -1)[self._own]
        else:
            out = grad if unit.shard_size == 1 else self._output(unit.reduce_dtype if wire else grad.dtype, grad.device)
        works: list[collectives.Handle] = []
        if unit.shard_size > 1:
            divide_by = 1.0 if unit.replicate_size > 1 else post
            h = self._reduce_scatter(out, grad, divide_by, wire)
            assert h is not None
            works.append(h)
        if all_reduce:
            for h in works:  # the all-reduce follows the reduce-scatter's local epilogue
                h.wait()
            if self._partial_sum is not None:  # reduce-scattered while the all-reduce was off
                out.add_(self._partial_sum)
                self._partial_sum = None
            h2 = collectives.all_reduce(out, unit.replicate_group, divide_by=post, async_op=True)
            assert h2 is not None
            works.append(h2)
        elif unit.shard_size == 1 and post != 1 and unit.replicate_size == 1:
            out.div_(post)
        partial_reduce = unit.replicate_size > 1 and not all_reduce
        packed = grad if unit.shard_size > 1 else None
        if packed is not None:
            buffers.POOL.lend(packed)  # comes back in finish()
        self._pending = _Pending(collectives.Handle(works), out, packed, partial_reduce, in_place, used)

    def _launch_custom(self, grad: torch.Tensor, used: list[bool] | None) -> None:
        """Reduce-scatter ``grad`` (the packed full gradient, (N*S_t,)) through the unit's custom
        comm (:mod:`.custom_comm`), then all-reduce over the replicas as :meth:`launch` does."""
        unit = self.unit
        plan = custom_comm.reduce_plan(unit, self.force_sum, predivide_factor)
        all_reduce = unit.replicate_size > 1 and unit.all_reduce_grads
        post_here = plan.post if unit.replicate_size == 1 else 1.0  # else after the all-reduce
        out, handle = custom_comm.reduce_scatter(unit, self.custom_reduce_scatter, grad, plan, post_here)
        buffers.POOL.release(grad)  # copied into the comm's input: the next unit of this size packs into it
        works = [handle]
        if all_reduce:
            handle.wait()
            if self._partial_sum is not None:  # reduce-scattered while the all-reduce was off
                out.add_(self._partial_sum)
                self._partial_sum = None
            divide_by = plan.replica_divide * plan.post
            h2 = collectives.all_reduce(out, unit.replicate_group, divide_by=divide_by, async_op=True)
            assert h2 is not None
            works.append(h2)
        partial_reduce = unit.replicate_size > 1 and not all_reduce
        self._pending = _Pending(collectives.Handle(works), out, None, partial_reduce, False, used)

    def _launch_hooked(self, grad: torch.Tensor, used: list[bool] | None) -> None:
        """Reduce ``grad`` (the packed full gradient, (N*S_t,)) with the registered communication
        hook, synchronously, as torch FSDP1 calls it: ``hook(state, grad)`` in place when the
        unit is not sharded (NO_SHARD), else ``hook(state, grad, out)`` with ``out`` (S_t,) for
        this rank's chunk (rank r's is chunk r of ``grad``: ``reduce_scatter_tensor``'s layout).
        The hook divides (torch's ``DefaultState`` does); fullshard adds no division."""
        assert self.comm_hook is not None
        state, hook = self.comm_hook
        unit = self.unit
        packed = None
        if unit.shard_size == 1:
            hook(state, grad)
            out = grad
        else:
            out = self._output(grad.dtype, grad.device)
            hook(state, grad, out)
            packed = grad
            buffers.POOL.lend(packed)  # comes back in finish()
        self._pending = _Pending(collectives.Handle(None), out, packed, False, False, used)

    def _reduces_in_place(self, grad: torch.Tensor) -> bool:
        """Whether the gradient shards can stay in this rank's chunk of the packed ``grad``.

        For a unit whose full buffer's size is its own (:attr:`in_place`; typically the root:
        embeddings and head): the pool keeps that buffer for this unit alone between steps, so
        the shards' gradients can live in it until ``zero_grad`` instead of in a buffer of their
        own (S_t bytes less at every moment of the step; issue 33). Only when the shards take
        ``out`` as it is (no cast, no offload, no replica all-reduce) and the collectives reduce
        in place (gloo, two ranks).
        """
        unit = self.unit
        grad_dtype = grad.dtype if unit.config.keep_low_precision_grads else unit.dtype
        return (
            self.in_place
            and unit.shard_size == 2
            and unit.replicate_size == 1
            and grad.dtype == grad_dtype == unit.compute_dtype  # the pool's packed buffer, kept as is
            and grad.device == unit.shard_device
            and not unit.config.offload
            and buffers.whole(grad)
            and collectives.reduces_in_place(unit.shard_group)
        )

    def _reduce_scatter(
        self, out: torch.Tensor, grad: torch.Tensor, divide_by: float, wire: str | None
    ) -> collectives.Handle | None:
        """Start the reduce-scatter of the packed ``grad`` (N*S_t,) into ``out`` (S_t,): exact, or
        quantized on the ``wire`` ("bf16", "int8": blocks per parameter, rounded stochastically)."""
        unit = self.unit
        if wire is None:
            return collectives.reduce_scatter(out, grad, unit.shard_group, divide_by=divide_by, async_op=True)
        quant = unit.config.comm_quantization
        assert quant is not None
        return quantized.reduce_scatter_quantized(
            out,
            grad,
            unit.shard_group,
            wire,
            quant.block_size,
            divide_by=divide_by,
            generator=quantized.rounding_generator(grad.device) if wire == "int8" else None,
            async_op=True,
            segments=[sp.spec.padded_shard_numel for sp in unit.trainable],
        )

    def _output(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Where the reduce-scatter writes this rank's gradient shard, shape (S_t,).

        On CPU, last step's buffer when nothing holds it any more (``zero_grad`` dropped the
        shards' ``.grad`` views): reused, it costs no fresh pages. Otherwise a new buffer.
        """
        last = self._last_out
        if (
            last is not None
            and last.numel() == self.unit.grad_numel  # not after a relayout_trainable
            and last.dtype == dtype
            and last.device == device
            and buffers.sole_owner(last)
        ):
            return last
        out = torch.empty(self.unit.grad_numel, dtype=dtype, device=device)
        self._last_out = out if device.type == "cpu" else None
        return out

    @torch.no_grad()  # also in a backward with create_graph=True (the shards' .grad are views)
    def finish(self) -> None:
        """Wait for the pending reduction and add the result to the shards' ``.grad``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.handle.wait()
        if pending.packed is not None and not pending.in_place:
            buffers.POOL.release(pending.packed, lent=True)  # the next unit of this size packs into it
        out = pending.out
        if pending.partial_reduce:  # set_requires_all_reduce(False): sums kept until an all-reduce takes them
            if self._partial_sum is None:
                self._partial_sum = out.clone()
            else:
                self._partial_sum.add_(out)
            return
        if self.all_reduce_hook is not None:  # after the replica all-reduce, before the cast, as torch's
            self.all_reduce_hook(out)
        unit = self.unit
        # before a non-blocking copy to the host
        unused = set() if pending.used is None else unused_here(pending.used, unit.trainable_local_views(out))
        grad_dtype = out.dtype if unit.config.keep_low_precision_grads else unit.dtype
        if out.dtype != grad_dtype or out.device != unit.shard_device:
            host = self._grad_buffer(out.shape, grad_dtype)
            host.copy_(out, non_blocking=host.is_pinned())
            out = host
        viewed = False  # some shard's .grad is now a view of ``out``
        views = unit.trainable_local_views(out)
        left_none = self.use.undecided = set()  # unused parameters without a .grad, for now
        for i, (sp, g) in enumerate(zip(unit.trainable, views)):
            assert sp.shard is not None
            current = sp.local_grad()
            if current is None and i in unused:
                left_none.add(i)
                continue
            if current is None:
                viewed = True
                sp.set_grad(g)
            else:
                current.add_(g)
        if pending.in_place and pending.packed is not None:
            if viewed:  # the shards' gradients live in it until reclaim()
                self._pinned = pending.packed
                buffers.POOL.forget_lent(pending.packed)
            else:
                buffers.POOL.release(pending.packed, lent=True)
        for i, sp in enumerate(unit.trainable):
            if i not in left_none:
                sp.run_grad_hooks()

    def fill_zeros(self) -> None:
        """Give a unit that backward did not reach a zero full gradient to reduce (see
        :attr:`reduce_unreached`), unless it holds gradients already. No parameter got a
        gradient here: under :attr:`unused_grads_none` a ``.grad`` stays None where the reduced
        shard is zero, as on a rank that reached the unit without using the parameter (the late
        round of :mod:`.reduce_order` fills a unit whose earlier reduction cleared that record)."""
        full = self.unit.full_flat
        if full.grad is None and self._unsynced is None and self.unit.grad_numel > 0:
            full.grad = torch.zeros(full.shape, dtype=full.dtype, device=full.device)
            if self.unused_grads_none and self.use.noted is None:
                self.use.noted = [False] * len(self.unit.trainable)

    def discard(self) -> None:
        """Drop every gradient not yet in the shards' ``.grad`` (an iteration an exception
        aborted: :func:`fullshard.engine.recovery.reset_iteration`): wait for a reduction in
        flight and throw its result away, and drop what was accumulated since the last reduction
        (the full flat gradient, the sums kept while gradient sync or the replica all-reduce was
        off). The shards' ``.grad`` stay as they are, but for the zero placeholders of
        :meth:`hold_unsynced`, which go."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.handle.wait()  # the other ranks' parts arrive into ``out`` until then
            if pending.packed is not None:
                buffers.POOL.release(pending.packed, lent=True)
        self.unit.full_flat.grad = None
        self._unsynced = self._partial_sum = None
        for use in self.uses():
            use.drop()
        marks, self._marks = self._marks, None
        for sp, grad, _, placeholder in marks or ():
            if placeholder and sp.shard is not None and sp.shard.grad is grad:
                sp.shard.grad = None

    @torch.no_grad()  # also in a backward with create_graph=True
    def _give_zero(self, i: int) -> None:
        """A zero ``.grad`` (the dtype the reductions give) for trainable parameter ``i``, then
        its post-accumulate-grad hooks: the settle's (:mod:`.grad_use`)."""
        unit = self.unit
        dtype = unit.reduce_dtype if unit.config.keep_low_precision_grads else unit.dtype
        sp = unit.trainable[i]
        assert sp.shard is not None
        sp.set_grad(torch.zeros_like(sp.local, dtype=dtype))
        sp.run_grad_hooks()

    def _grad_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Where cast or offloaded gradients land: reused while no shard still holds the last one.

        Pinned allocations are slow, so under offload the buffer is kept between steps; it is
        replaced when gradients are being accumulated (a shard's ``.grad`` may be a view of it).
        """
        unit = self.unit
        cached = self._host_grad
        if (
            cached is not None
            and cached.dtype == dtype
            and cached.shape == shape
            and all(sp.shard is not None and sp.shard.grad is None for sp in unit.trainable)
        ):
            return cached
        pin = unit.config.offload and torch.cuda.is_available()
        buffer = torch.empty(shape, dtype=dtype, device=unit.shard_device, pin_memory=pin)
        if unit.config.offload:
            self._host_grad = buffer
        return buffer
