"""Units with all-gather extension parameters (FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).

:func:`unit_class` picks :class:`ExtensionUnit` for a unit that owns a parameter whose tensor
defines the hooks (see :mod:`.extension_param` for the vocabulary), and the plain
:class:`~fullshard.engine.unit.Unit` otherwise, so units without such parameters run exactly
the code they ran before. An ExtensionUnit is a Unit over its plain parameters (flat buffers,
one all-gather, one reduce-scatter) plus its extension parameters beside them:

- unshard: the pre hooks' all-gather inputs of every extension parameter go out in one more
  all-gather (as bytes, since they may have several dtypes); at the wait the post hooks build
  the unsharded parameters, which the forward sees.
- a shard the program replaced (``load_state_dict(assign=True)`` of a DTensor over the
  subclass, as torchtune loads QLoRA's NF4 weights into a model sharded on the meta device) is
  taken at the next unshard, as torch's FSDP2 takes it at its lazy init.
- backward: trainable extension parameters reach the forward through one autograd node per
  forward (:class:`_ExtensionFull`) whose backward collects their gradients. The unit's
  post-backward waits for both parts, the plain flat gradient and the extension gradients;
  a part that never reports (unused parameters, recomputed forwards) is reduced at the end of
  backward instead. The unit's gradient state (``unit.grads``) covers the extension gradients
  too, so reduction turns (:mod:`.reduce_order`) hold and zero-fill both parts.
- the extension gradients are reduce-scattered beside the plain ones and land in the shards'
  ``.grad``: :mod:`.extension_reduce`.

Only ``fully_shard`` builds them (:func:`attach` registers the shards on the unit's mesh);
``reshard_after_forward=int`` is not supported, as in torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.comm import collectives, flight_recorder
from fullshard.engine import shard_sync
from fullshard.engine.dynamo_guard import outside_dynamo
from fullshard.engine.extension_param import ExtensionParam, has_extension, make_shard
from fullshard.engine.extension_reduce import ExtensionGrads
from fullshard.engine.layout import ParamEntry
from fullshard.engine.sharded_param import ShardedParam, ShardSpec, local_tensor
from fullshard.engine.unit import Unit
from fullshard.engine.unit_config import ShardState, UnitConfig

__all__ = ["ExtensionUnit", "attach", "check_plain", "unit_class"]


def _dispatch_subclass(p: torch.Tensor) -> bool:
    """Whether ``p`` is a tensor subclass below autograd (one that defines __torch_dispatch__),
    other than DTensor."""
    cls = type(p)
    if cls in (torch.Tensor, nn.Parameter) or cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return False
    return not any(c.__name__ == "DTensor" for c in cls.__mro__)


def unit_class(params: Sequence[ParamEntry]) -> type[Unit]:
    """:class:`ExtensionUnit` when a parameter defines the all-gather extension, else Unit.

    Raises:
        ValueError: a parameter defines only one of the two hooks.
        NotImplementedError: a tensor-subclass parameter without the hooks.
    """
    extension = False
    for fqn, p, _ in params:
        if has_extension(p):
            extension = True
        elif _dispatch_subclass(p):
            raise NotImplementedError(
                f"parameter {fqn} is a {type(p).__name__}, a tensor subclass without fsdp_pre_all_gather / "
                "fsdp_post_all_gather: fullshard would shard its plain values and drop the subclass. Define both "
                "hooks (FSDP2's all-gather extension) or make it a plain tensor (or ignore it) before sharding"
            )
    return ExtensionUnit if extension else Unit


def check_plain(params: Sequence[ParamEntry], front_end: str) -> None:
    """Refuse extension parameters where ``front_end`` cannot shard them (the FSDP1 wrapper).

    Raises:
        NotImplementedError: naming the first such parameter.
    """
    if unit_class(params) is ExtensionUnit:
        fqn = next(f for f, p, _ in params if has_extension(p))
        raise NotImplementedError(
            f"parameter {fqn} defines FSDP2's all-gather extension (fsdp_pre_all_gather), which {front_end} "
            "does not run: shard the model with fullshard.fully_shard"
        )


class ExtensionUnit(Unit):
    """A Unit whose extension parameters are gathered by their own hooks (module note).

    Args: as :class:`~fullshard.engine.unit.Unit`; the extension parameters are taken out of
    ``params`` and sharded when :func:`attach` gives the unit its mesh.
    """

    def __init__(
        self,
        name: str,
        params: list[ParamEntry],
        shard_group: collectives.ProcessGroup | None,
        replicate_group: collectives.ProcessGroup | None,
        config: UnitConfig,
    ) -> None:
        plain = [e for e in params if not has_extension(e[1])]
        super().__init__(name, plain, shard_group, replicate_group, config)
        self._entries = [e for e in params if has_extension(e[1])]
        self.ext: list[ExtensionParam] = []
        self.grads: ExtensionGrads = ExtensionGrads(self, self.ext)
        self._mesh: Any = None
        self._mp_policy: Any = None
        self._gather: collectives.Handle | None = None
        self._gathering = False
        self._anchor = torch.empty(0, requires_grad=True)  # gives _ExtensionFull's outputs a graph
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()  # _ExtensionFull contexts not yet run
        self._waiting: set[str] = set()  # parts ("plain", "ext") whose gradients are still to come

    def layout_fixed(self) -> str | None:
        return super().layout_fixed() or (
            " in a unit with all-gather extension (float8) parameters, whose trainable set fullshard fixes "
            "when it builds the unit: set requires_grad before fully_shard"
        )

    # ------------------------------------------------------------------ gather
    def _unshard(self, async_op: bool) -> None:
        if self.ext and self.shard_state is ShardState.SHARDED and not self._gathering:
            self._start_gather()
        super()._unshard(async_op)
        if not async_op:
            self.wait_for_unshard()

    def _take_replaced(self) -> None:
        """Adopt the extension parameters registered in the shards' place since the last gather.

        Raises:
            ValueError: one laid out otherwise than its shard, or without the extension hooks.
            RuntimeError: a shard still on the meta device.
        """
        for ep in self.ext:
            sp = ep.sp
            registered = shard_sync.replacement(sp)
            if registered is None:
                continue
            shard_sync.check_replacement(self, sp, registered)
            if not has_extension(local_tensor(registered)):
                raise ValueError(
                    f"FSDP unit {self.name!r}: parameter {sp.fqn} was a {type(sp.local).__name__} (all-gather "
                    f"extension) and was replaced by a DTensor over a {type(local_tensor(registered)).__name__}; "
                    "give it a local tensor of the same class (e.g. to_nf4 of this rank's rows)"
                )
            sp.register_shard(registered)  # type: ignore[arg-type]
        meta = [ep.sp.fqn for ep in self.ext if ep.sp.local.is_meta and ep.sp.spec.local_numel > 0]
        if meta:
            raise RuntimeError(
                f"FSDP unit {self.name!r}: all-gather extension parameters {meta} are still on the meta device; "
                "load a state dict with assign=True (DTensors over this rank's rows) before the first forward"
            )

    def _start_gather(self) -> None:
        self._take_replaced()
        n = self.shard_size
        inputs = [ep.pre_all_gather(self._mesh, self._mp_policy, self.device) for ep in self.ext]
        for ep, ins in zip(self.ext, inputs):
            ep.prepare_outputs(ins, n, self.device)
        flat = [t for ins in inputs for t in ins]
        writers = [w for ep in self.ext for w in ep.writers]
        self._gathering = True
        if n == 1:
            with torch.no_grad():
                for w, t in zip(writers, flat):
                    w.copy_(t)
            return
        sizes = [t.numel() * t.element_size() for t in flat]
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        torch.cat([t.contiguous().view(torch.uint8) for t in flat], out=send)
        received = torch.empty(n * send.numel(), dtype=torch.uint8, device=self.device)
        handle = collectives.all_gather(received, send, self.shard_group, async_op=True)
        assert handle is not None

        def copy_out() -> None:
            outs = [w.view(torch.uint8).view(n, -1) for w in writers]
            torch.split_with_sizes_copy(received.view(n, -1), sizes, dim=1, out=outs)

        self._gather = collectives.Handle([handle], copy_out)

    def wait_for_unshard(self) -> None:
        super().wait_for_unshard()
        if not self._gathering:
            return
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        self._gathering = False
        for ep in self.ext:
            ep.post_all_gather()

    def install_full_params(self, for_recompute: bool = False) -> None:
        super().install_full_params(for_recompute)
        if not self.ext:
            return
        grad = torch.is_grad_enabled() and not for_recompute
        if grad and self.trainable and self.full_flat.requires_grad:
            self._waiting.add("plain")
        views: list[Any] = [ep.unsharded for ep in self.ext]
        trainable = [i for i, ep in enumerate(self.ext) if ep.sp.requires_grad]
        if grad and trainable:
            self._waiting.add("ext")
            outs = _ExtensionFull.apply(self._anchor, self, *[views[i] for i in trainable])
            for i, out in zip(trainable, outs):
                views[i] = out
        for ep, view in zip(self.ext, views):
            ep.sp.install_full(view)

    def uninstall_full_params(self) -> None:
        super().uninstall_full_params()
        for ep in self.ext:
            ep.sp.uninstall_full()

    def reshard(self) -> None:
        if self._gathering:
            self.wait_for_unshard()
        gathered = self.shard_state is ShardState.UNSHARDED
        super().reshard()
        if gathered:
            for ep in self.ext:
                ep.free()

    def reshard_for_packing(self) -> None:
        # The extension parameters may still be read by backward until their own node has run.
        if "ext" not in self._waiting and all(ep.sp.requires_grad for ep in self.ext):
            super().reshard_for_packing()

    # ------------------------------------------------------------------ gradients
    def _grad_accumulated(self, full_flat: torch.Tensor) -> None:
        self._part_done("plain")

    def _part_done(self, part: str) -> None:
        self._waiting.discard(part)
        if not self._waiting and self.on_grad_ready is not None:
            self.on_grad_ready(self)

    def reduce_grads(self) -> None:
        if self.grads.reduce_unreached:  # an extension weight this rank's backward did not reach: zeros
            self.grads.zero_missing()  # (every rank packs the same parameters, as torch's)
        super().reduce_grads()
        with flight_recorder.at(self.name, "post-backward reduce-scatter"):
            self.grads.launch_ext()

    def finish_reduce(self) -> None:
        if self._waiting:  # a part never reported in backward: reduce what arrived now
            self._waiting.clear()
            if self.sync_grads:
                self.grads.launch()
                self.grads.launch_ext()
        super().finish_reduce()
        self.grads.finish_ext()

    @property
    def has_trainable(self) -> bool:
        return super().has_trainable or any(ep.sp.requires_grad for ep in self.ext)


class _ExtensionFull(torch.autograd.Function):
    """The unsharded extension parameters as the forward sees them; backward collects their
    gradients and, when the last such node of the unit has run, reports the part done."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, unit: ExtensionUnit, *fulls: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        unit._open.add(ctx)
        return tuple(f.view_as(f) for f in fulls)

    @staticmethod
    @outside_dynamo  # autograd calls it: from a compiled step's backward too, never to be traced
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        unit: ExtensionUnit = ctx.unit
        unit._open.discard(ctx)
        trainable = [ep for ep in unit.ext if ep.sp.requires_grad]
        for ep, g in zip(trainable, grads):
            if g is not None:
                ep.add_grad(g)
        if not unit._open:
            unit._part_done("ext")
        return (None, None) + (None,) * len(grads)


def attach(unit: Unit, mesh: Any, mp_policy: Any) -> None:
    """Shard ``unit``'s extension parameters on ``mesh`` (a no-op for other units).

    Args:
        unit: the unit ``fully_shard`` built.
        mesh: its DeviceMesh (1-D, or 2-D (replicate, shard)); the hooks get the shard dimension.
        mp_policy: fullshard's or torch's MixedPrecisionPolicy, or None; the hooks get torch's.

    Raises:
        NotImplementedError: ``reshard_after_forward`` given as an int.
        ValueError: a 2-D mesh without dimension names.
    """
    if not isinstance(unit, ExtensionUnit):
        return
    from torch.distributed.tensor import Replicate, Shard

    placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
    if unit.post_forward_shard is not None:
        raise NotImplementedError(
            "fully_shard: reshard_after_forward=<int> with all-gather extension parameters (torch's fully_shard "
            "does not support it either); pass True or False"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError("fully_shard: a 2-D mesh for all-gather extension parameters needs mesh_dim_names")
    unit._mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]
    unit._mp_policy = _torch_policy(mp_policy)
    param_dtype, reduce_dtype = unit._mp_policy.param_dtype, unit._mp_policy.reduce_dtype
    unit.grads.ext_reduce_dtype = None if reduce_dtype == param_dtype else reduce_dtype
    for fqn, p, slots in unit._entries:
        sp = ShardedParam(ShardSpec(p.shape, unit.shard_size, unit.rank), slots, fqn, p.requires_grad)
        sp.shard_group = unit.shard_group
        local = make_shard(p, sp)
        _register(sp, mesh, placements, local, p)
        # the dtype the post hook gets: the policy's, where it casts a floating-point parameter
        cast = param_dtype is not None and param_dtype != p.dtype and p.dtype.is_floating_point
        unit.ext.append(ExtensionParam(sp, slots[0].module, p.dtype, param_dtype if cast else p.dtype))
    unit._entries = []


def _register(sp: ShardedParam, mesh: Any, placements: Sequence[Any], local: torch.Tensor, p: torch.Tensor) -> None:
    shape = sp.spec.orig_shape
    stride = torch.empty(shape, device="meta").stride()
    sp.dtensor_spec = compat.make_dtensor_spec(mesh, tuple(placements), shape, stride, p.dtype)
    sp.register_shard(nn.Parameter(sp.as_registered(local), requires_grad=p.requires_grad))
    p._fullshard_sharded_as = sp.fqn  # type: ignore[attr-defined]  # met again: tied


def _torch_policy(mp_policy: Any) -> Any:
    """torch's MixedPrecisionPolicy with ``mp_policy``'s settings (what torch passes the pre hook)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_policy is None:
        return MixedPrecisionPolicy()
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    return MixedPrecisionPolicy(
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        output_dtype=mp_policy.output_dtype,
        cast_forward_inputs=mp_policy.cast_forward_inputs,
    )
