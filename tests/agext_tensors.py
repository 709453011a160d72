"""Test tensor subclasses for FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``), shaped like torchao's float8 weights but on CPU with bfloat16.

- :class:`Bf16CommWeight`: an fp32 weight (the parameter) that all-gathers in bfloat16. Its
  pre-all-gather pads this rank's rows to the padded shard size and casts them to bfloat16.
  Its post-all-gather returns the gathered bfloat16 tensor itself when the compute dtype is
  bfloat16, else a :class:`Bf16Stored` over it (fp32 outside, the gathered bfloat16 inside),
  as torchao returns a float8 tensor over the gathered bytes. On a later gather (``out=``) it
  checks that ``out`` still reads the all-gather output's storage (refilled in place) and
  returns nothing.
- :class:`PlainWrapper`: a wrapper subclass without the hooks.

Every hook call is logged in :data:`CALLS` with the kinds of its arguments, so tests can
compare fullshard's calls with torch's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten
CALLS: list[tuple] = []

# Ops whose result stays a wrapper (views, copies, new tensors like the input); in-place ops
# return their wrapped first argument; everything else computes on the inner tensors and
# returns plain tensors (as torchao's weight wrapper does).
_KEEP = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.t.default,
    aten.clone.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten._to_copy.default,
}


def _in_place(func: Any) -> bool:
    return func._schema.name.endswith("_") or any(a.is_out for a in func._schema.arguments)


class _Wrapper(torch.Tensor):
    """A wrapper subclass over one inner tensor ``_t`` of the same shape."""

    _t: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=dtype or inner.dtype,
            device=inner.device,
            requires_grad=inner.requires_grad,
        )

    def __init__(self, inner: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self._t = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._t!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_t"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> Any:
        return cls(inner["_t"])

    @classmethod
    def _unwrap(cls, t: torch.Tensor) -> torch.Tensor:
        return t._t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inner_args = tree_map_only(cls, cls._unwrap, args)
        inner_kwargs = tree_map_only(cls, cls._unwrap, kwargs)
        if func in _KEEP:
            raw = tree_map_only(cls, lambda t: t._t, args)  # views keep the stored dtype
            out = func(*raw, **tree_map_only(cls, lambda t: t._t, kwargs))
            return tree_map_only(torch.Tensor, cls, out)
        out = func(*inner_args, **inner_kwargs)
        if _in_place(func) and args and isinstance(args[0], cls):
            return args[0]
        return out


class PlainWrapper(_Wrapper):
    """A wrapper subclass with no all-gather extension."""


class Bf16Stored(_Wrapper):
    """Reads as fp32, stores bfloat16 (the gathered bytes): computes by upcasting."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
        return _Wrapper.__new__(cls, inner, torch.float32)

    @classmethod
    def _unwrap(cls, t: torch.Tensor) -> torch.Tensor:
        return t._t.to(torch.float32)


class Bf16CommWeight(_Wrapper):
    """An fp32 weight that FSDP all-gathers in bfloat16."""

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS.append(
            (
                "pre",
                type(mesh).__name__,
                mesh.size(),
                type(outer_size).__name__,
                tuple(outer_size),
                tuple(outer_stride),
                type(module).__name__,
                f"{type(mp_policy).__module__}.{type(mp_policy).__name__}",
                mp_policy.param_dtype,
                tuple(self.shape),
            )
        )
        rows = -(-outer_size[0] // mesh.size())
        data = self._t
        if data.shape[0] < rows:  # this rank holds fewer rows than the padded shard: pad
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data.to(torch.bfloat16).contiguous(),), ("bf16", tuple(outer_size))

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (data,) = all_gather_outputs
        CALLS.append(
            (
                "post",
                len(all_gather_outputs),
                tuple(data.shape),
                data.dtype,
                type(data).__name__,
                metadata,
                param_dtype,
                None if out is None else type(out).__name__,
                None if out is None else type(out.data if type(out) is torch.nn.Parameter else out).__name__,
            )
        )
        if out is not None:
            inner = out._t if isinstance(out, _Wrapper) else out
            assert inner.untyped_storage().data_ptr() == data.untyped_storage().data_ptr(), "out= must reuse the gather"
            return None
        if param_dtype == torch.bfloat16:
            return data, ()
        return Bf16Stored(data), (data,)


class MeshOnlyWeight(Bf16CommWeight):
    """The older pre hook signature, ``fsdp_pre_all_gather(self, mesh)`` (evenly sharded only)."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:  # type: ignore[override]
        CALLS.append(("pre-mesh-only", type(mesh).__name__, mesh.size(), tuple(self.shape)))
        return (self._t.to(torch.bfloat16).contiguous(),), ("bf16", None)


class RowInt8Weight(Bf16CommWeight):
    """An fp32 weight that all-gathers as two tensors of two dtypes: int8 rows and an fp32 scale
    per row (evenly sharded only: the scale has no padded-shard shape)."""

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS.append(("pre-int8", mesh.size(), tuple(outer_size), type(module).__name__, tuple(self.shape)))
        scale = self._t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return ((self._t / scale).round().to(torch.int8), scale), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        q, scale = all_gather_outputs
        CALLS.append(("post-int8", q.dtype, tuple(q.shape), scale.dtype, tuple(scale.shape), out is None))
        value = (q.to(torch.float32) * scale).to(param_dtype)
        if out is not None:
            out.data.copy_(value)  # refreshed in place, unseen by autograd's version counter
            return None
        return value, (value,)


class ThreeArgWeight(Bf16CommWeight):
    """A pre hook of a signature torch does not call."""

    def fsdp_pre_all_gather(self, mesh: Any, module: Any) -> Any:  # type: ignore[override]
        raise AssertionError("never called")


def wrap_weights(model: torch.nn.Module, cls: type = Bf16CommWeight) -> torch.nn.Module:
    """Make every 2-D parameter of ``model`` a ``cls`` parameter over its values."""
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.dim() == 2:
                m._parameters[name] = torch.nn.Parameter(cls(p.detach().clone()), requires_grad=p.requires_grad)
    return model


def clear() -> None:
    CALLS.clear()


__all__ = [
    "CALLS",
    "Bf16CommWeight",
    "Bf16Stored",
    "MeshOnlyWeight",
    "PlainWrapper",
    "RowInt8Weight",
    "ThreeArgWeight",
    "clear",
    "wrap_weights",
]
