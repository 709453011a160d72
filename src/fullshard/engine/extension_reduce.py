"""The gradient side of an ExtensionUnit (:mod:`.all_gather_extension`): its extension gradients.

:class:`ExtensionGrads` is such a unit's gradient state (``unit.grads``): the plain parameters'
(:class:`~fullshard.engine.reduce.GradReducer`) and the gradients of the unsharded extension
parameters collected in backward (``ExtensionParam.grad``, full shapes), which the unit reduces
with them. What the reduction turns read (:mod:`.reduce_order`) covers both parts.

The extension gradients are packed rank-major, as the plain ones, in the reduce dtype (the
mixed-precision ``reduce_dtype``, else the gradients' own), reduce-scattered, and land, cast to
each parameter's dtype, in the shards' ``.grad`` as DTensors with plain local tensors, as torch's
FSDP2 leaves them. Every rank packs the same parameters (the collectives' sizes must match):
under ``reduce_unreached`` the unit zero-fills every trainable one that holds no gradient; under
``unused_grads_none`` too, once any got one, and records which got one here
(:mod:`.grad_use`): a parameter no rank used keeps ``.grad`` None, one another rank used gets
zeros at the settle.
"""

from __future__ import annotations

from typing import Any

import torch

from fullshard.comm import collectives
from fullshard.comm.collectives import predivide_factor
from fullshard.engine.extension_param import ExtensionParam
from fullshard.engine.grad_pack import pack_into
from fullshard.engine.grad_use import GradUse, unused_here
from fullshard.engine.layout import UnitLayout
from fullshard.engine.reduce import GradReducer

__all__ = ["ExtensionGrads"]

# An extension reduction in flight: its handle, this rank's rows of the output, the parameters
# packed, and their use flags (:meth:`ExtensionGrads.launch_ext`'s).
_InFlight = tuple[collectives.Handle | None, torch.Tensor, list[ExtensionParam], list[bool] | None]


class ExtensionGrads(GradReducer):
    """An ExtensionUnit's gradient state (module note).

    Args:
        unit: the unit (its plain parameters' layout, its groups and divide factor).
        ext: its extension parameters, the unit's own list (filled when it is attached).
    """

    def __init__(self, unit: UnitLayout, ext: list[ExtensionParam]) -> None:
        super().__init__(unit)
        self.ext = ext
        self.ext_reduce_dtype: torch.dtype | None = None  # the policy's reduce_dtype, when not param_dtype
        self.ext_use = GradUse(self._give_ext_zero)
        self._reduction: _InFlight | None = None

    @property
    def has_pending(self) -> bool:
        return super().has_pending or self._reduction is not None

    @property
    def holds_unreduced(self) -> bool:
        return super().holds_unreduced or any(ep.grad is not None for ep in self.ext)

    def uses(self) -> list[GradUse]:
        return [self.use, self.ext_use]

    def _trainable_ext(self) -> list[ExtensionParam]:
        return [ep for ep in self.ext if ep.sp.requires_grad]

    def zero_missing(self) -> None:
        """A zero gradient for each trainable extension parameter that holds none (in the dtype
        of its unsharded tensor, the dtype of its gradient)."""
        for ep in self._trainable_ext():
            if ep.grad is None:
                dtype = ep.param_dtype if ep.unsharded is None else ep.unsharded.dtype
                ep.grad = torch.zeros(ep.sp.spec.orig_shape, dtype=dtype, device=self.unit.device)

    def fill_zeros(self) -> None:
        """Zeros for each part that holds no gradient: the plain one, each trainable extension
        parameter (:meth:`zero_missing`)."""
        super().fill_zeros()
        self.zero_missing()

    def launch_ext(self) -> None:
        """Reduce-scatter the collected extension gradients (rank-major, as the plain ones),
        first landing the extension reduction still in flight, if any."""
        self.finish_ext()
        items = [ep for ep in self.ext if ep.grad is not None]
        if not items:
            return
        used: list[bool] | None = None
        if self.unused_grads_none:  # every trainable one, zeros where no gradient reached it here
            items = self._trainable_ext()
            self.ext_use.note([ep.grad is not None for ep in items])
            used = self.ext_use.take()
            self.zero_missing()
            self.ext_use.launched(used, len(items), True)
        grads = [ep.grad for ep in items]
        for ep in items:
            ep.grad = None
        unit = self.unit
        dtypes = {g.dtype for g in grads if g is not None}
        if len(dtypes) > 1:
            raise RuntimeError(
                f"FSDP unit {unit.name!r}: the unsharded extension parameters' gradients have several dtypes "
                f"({sorted(map(str, dtypes))}); FSDP reduces them together and needs one"
            )
        dtype = self.ext_reduce_dtype or dtypes.pop()
        packed = _pack(items, grads, unit.shard_size, dtype)
        ranks = unit.shard_size * unit.replicate_size
        pre = predivide_factor(ranks) if dtype in (torch.float16, torch.bfloat16) and unit.divide_factor is None else 1
        if pre > 1:
            packed.div_(pre)
        post = (unit.divide_factor or ranks) / pre
        out, handle = packed, None
        if unit.shard_size > 1:
            out = torch.empty(packed.numel() // unit.shard_size, dtype=dtype, device=packed.device)
            handle = collectives.reduce_scatter(
                out, packed, unit.shard_group, divide_by=1.0 if unit.replicate_size > 1 else post, async_op=True
            )
        if unit.replicate_size > 1:
            if not unit.all_reduce_grads:
                raise NotImplementedError("set_requires_all_reduce(False) with all-gather extension parameters")
            if handle is not None:
                handle.wait()
            handle = collectives.all_reduce(out, unit.replicate_group, divide_by=post, async_op=True)
        elif unit.shard_size == 1 and post != 1:
            out.div_(post)
        self._reduction = (handle, out, items, used)

    @torch.no_grad()  # also in a backward with create_graph=True
    def finish_ext(self) -> None:
        """Wait for the extension reduction; each shard's ``.grad`` gets (or adds) its rows, but
        for one no gradient reached here whose rows are zeros and that has none: it stays None
        until the settle (:mod:`.grad_use`)."""
        if self._reduction is None:
            return
        handle, out, items, used = self._reduction
        self._reduction = None
        if handle is not None:
            handle.wait()
        offset, rows = 0, []
        for ep in items:
            spec = ep.sp.spec
            rows.append(out[offset : offset + spec.local_numel].view(spec.local_shape))
            offset += spec.padded_shard_numel
        unused = unused_here(used, rows)  # (items are the trainable ones where ``used`` is given)
        left_none = self.ext_use.undecided = set()
        for i, (ep, g) in enumerate(zip(items, rows)):
            current = ep.sp.local_grad()
            if current is None and i in unused:
                left_none.add(i)
                continue
            g = g.to(device=ep.sp.local.device, dtype=ep.dtype)  # to the shard (in CPU memory under offload)
            if current is None:
                ep.sp.set_grad(g)
            else:
                current.add_(g)
        for i, ep in enumerate(items):
            if i not in left_none:
                ep.sp.run_grad_hooks()

    def discard(self) -> None:
        """Drop the extension gradients collected since the last reduction too (those held
        while gradient sync was off) and an extension reduction in flight, as
        :meth:`GradReducer.discard` drops the plain ones."""
        super().discard()
        for ep in self.ext:
            ep.grad = None
        reduction, self._reduction = self._reduction, None
        if reduction is not None and reduction[0] is not None:
            reduction[0].wait()  # the other ranks' parts arrive until then; the result is dropped

    @torch.no_grad()  # also in a backward with create_graph=True
    def _give_ext_zero(self, i: int) -> None:
        """A zero ``.grad`` (the parameter's dtype) for trainable extension parameter ``i``, then
        its post-accumulate-grad hooks: the settle's (:mod:`.grad_use`)."""
        ep = self._trainable_ext()[i]
        ep.sp.set_grad(torch.zeros(ep.sp.spec.local_shape, dtype=ep.dtype, device=ep.sp.local.device))
        ep.sp.run_grad_hooks()


def _pack(items: list[ExtensionParam], grads: list[Any], n: int, dtype: torch.dtype) -> torch.Tensor:
    """Full gradients (shapes ``orig_shape``) packed rank-major in ``dtype``, (N * sum of padded shards,)."""
    specs = [ep.sp.spec for ep in items]
    device = next(g for g in grads if g is not None).device
    out = torch.empty(n, sum(spec.padded_shard_numel for spec in specs), dtype=dtype, device=device)
    pack_into(out, grads, specs)
    return out.reshape(-1)
