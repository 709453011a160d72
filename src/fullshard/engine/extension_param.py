"""One parameter under FSDP2's all-gather extension: a tensor subclass that decides what is gathered.

A parameter whose tensor defines ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (torchao's
float8 weights, NF4 weights) is not copied into its unit's flat buffers. Its shard stays an
instance of its own class: the padded shard is made by the subclass itself (``new_zeros``, then
this rank's rows copied in), and the registered parameter is a DTensor over the first
``local_rows`` rows of it, as torch's ``fully_shard`` registers it. Vocabulary, per gather:

- **all-gather inputs**: what ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
  mp_policy)`` returns for the shard, any number of tensors of any dtypes (e.g. float8 data and
  a scale), each with the padded shard's rows when the shard has fewer (uneven sharding).
- **all-gather outputs**: one tensor per input, N times its elements, kept for the parameter's
  life; their memory is freed at each reshard and given back before the next gather, so
  tensors that alias them (what the post hook built over them) stay valid.
- **unsharded parameter**: ``fsdp_post_all_gather(outputs, metadata, param_dtype)``'s tensor at
  the first gather, viewed as the full shape; later gathers pass it back as ``out=`` for the
  subclass to refresh in place. The forward sees it (through the unit's autograd node); the
  gradient of it is reduce-scattered into the shard's ``.grad`` in the reduce dtype.

Signatures as torch (2.11 to 2.13) inspects them: a pre hook taking only ``mesh`` (the old form)
or all five arguments; the post hook takes ``out=`` by keyword.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from fullshard.engine.sharded_param import ShardedParam


def has_extension(t: torch.Tensor) -> bool:
    """Whether ``t`` defines both hooks of the all-gather extension.

    Raises:
        ValueError: it defines only one of them (torch's ``fully_shard`` refuses it too).
    """
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        have, lack = ("fsdp_pre_all_gather", "fsdp_post_all_gather")[:: 1 if pre else -1]
        raise ValueError(
            f"{type(t).__name__} defines {have} but not {lack}: an all-gather extension needs both "
            "(see torch.distributed.fsdp.fully_shard's all-gather extension)"
        )
    return pre


_ARITY: dict[type, int] = {}


def _pre_hook_arity(local: torch.Tensor) -> int:
    """Parameters of ``type(local).fsdp_pre_all_gather`` besides self: 1 (mesh only) or 5."""
    cls = type(local)
    n = _ARITY.get(cls)
    if n is None:
        n = _ARITY[cls] = len(inspect.signature(local.fsdp_pre_all_gather).parameters)  # type: ignore[attr-defined]
    if n not in (1, 5):
        raise TypeError(
            f"{cls.__name__}.fsdp_pre_all_gather takes {n} arguments; expected (self, mesh, outer_size, "
            "outer_stride, module, mp_policy), or (self, mesh) in the older form"
        )
    return n


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage under a tensor with its own version counter: writes through it leave the
    tensors autograd saved (views of ``t``) valid, as the refilled data is what they expect."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return out


def _resize(t: torch.Tensor, allocate: bool) -> None:
    storage = t.untyped_storage()
    want = t.numel() * t.element_size() if allocate else 0
    if allocate and storage.size() >= want:
        return
    if storage.size() != want:
        storage.resize_(want)


@dataclasses.dataclass
class ExtensionParam:
    """The gather state of one extension parameter of a unit (see the module note).

    Attributes:
        sp: geometry, slots and registered shard (a DTensor over the subclass's rows).
        module: the module that registers the parameter (the hooks' ``module``).
        dtype: the parameter's dtype (its gradient's, after the reduction).
        param_dtype: the dtype the post hook is given (the policy's ``param_dtype`` or ``dtype``).
        outputs: the all-gather outputs, shape (N * numel of input i,), empty until the first gather.
        writers: aliases of ``outputs`` the copy-out writes through.
        input_sizes: the shapes of the last all-gather inputs.
        metadata: what the pre hook returned for the post hook.
        unsharded: the unsharded parameter (full shape), None before the first gather.
        inner: the tensors the post hook named for freeing at reshard.
        grad: the gradient of ``unsharded`` collected in backward, or None.
    """

    sp: ShardedParam
    module: nn.Module
    dtype: torch.dtype
    param_dtype: torch.dtype
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    writers: list[torch.Tensor] = dataclasses.field(default_factory=list)
    input_sizes: list[torch.Size] = dataclasses.field(default_factory=list)
    metadata: Any = None
    unsharded: nn.Parameter | None = None
    inner: tuple[torch.Tensor, ...] = ()
    grad: torch.Tensor | None = None

    @property
    def stride(self) -> tuple[int, ...]:
        """Contiguous strides of the full shape (the hooks' ``outer_stride``)."""
        shape = self.sp.spec.orig_shape
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        return tuple(reversed(strides))

    def pre_all_gather(self, mesh: Any, mp_policy: Any, device: torch.device) -> list[torch.Tensor]:
        """Call the pre hook on the shard; its all-gather inputs, each flattened.

        Raises:
            TypeError: the hook has another signature.
            RuntimeError: an unevenly sharded parameter whose inputs lack the padded shard's rows.
        """
        spec = self.sp.spec
        local = self.sp.local
        if local.device != device:  # offloaded shards: the hook sees them on the compute device
            local = local.to(device, non_blocking=True)
        hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if _pre_hook_arity(local) == 1:
            inputs, self.metadata = hook(mesh)
        else:
            inputs, self.metadata = hook(mesh, spec.orig_shape, self.stride, self.module, mp_policy)
            padded = torch.Size((spec.chunk_rows, *spec.row_shape))
            if local.size() != padded and any(t.size() != padded for t in inputs):
                raise RuntimeError(
                    f"{self.sp.fqn}: unevenly sharded (shape {tuple(spec.orig_shape)} over {spec.shard_size} "
                    "ranks), so "
                    f"{type(local).__name__}.fsdp_pre_all_gather must return all-gather inputs of the padded "
                    f"shard size {tuple(padded)}, got {[tuple(t.size()) for t in inputs]}"
                )
        self.input_sizes = [t.size() for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def prepare_outputs(self, inputs: list[torch.Tensor], world: int, device: torch.device) -> None:
        """Create the all-gather outputs at the first gather, give them memory at later ones.

        Raises:
            RuntimeError: the pre hook changed the number, sizes or dtypes of its inputs.
        """
        kinds = [(t.numel() * world, t.dtype) for t in inputs]
        if not self.outputs:
            self.outputs = [torch.empty(n, dtype=d, device=device) for n, d in kinds]
            self.writers = [_alias(t) for t in self.outputs]
            return
        if kinds != [(t.numel(), t.dtype) for t in self.outputs]:
            raise RuntimeError(
                f"{self.sp.fqn}: fsdp_pre_all_gather returned inputs of other sizes or dtypes than at the first "
                f"gather ({[(n // world, d) for n, d in kinds]} against "
                f"{[(t.numel() // world, t.dtype) for t in self.outputs]}); FSDP keeps the gathered tensors"
            )
        for t in self.outputs:
            _resize(t, True)

    def post_all_gather(self) -> None:
        """Call the post hook on the all-gather outputs: the unsharded parameter at the first
        gather, the same one refreshed in place (``out=``) after that."""
        local: Any = self.sp.local
        gathered = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.input_sizes))
        with torch.no_grad():
            if self.unsharded is None:
                tensor, inner = local.fsdp_post_all_gather(gathered, self.metadata, self.param_dtype)
                full = torch.as_strided(tensor, self.sp.spec.orig_shape, self.stride, 0)
                self.unsharded = nn.Parameter(full, requires_grad=False)
                self.inner = tuple(inner)
            else:
                for t in self.inner:
                    _resize(t, True)
                local.fsdp_post_all_gather(gathered, self.metadata, self.param_dtype, out=self.unsharded)
        self.metadata = None

    def free(self) -> None:
        """Take the gathered memory away (0 bytes); the tensors stay for the next gather."""
        for t in (*self.outputs, *self.inner):
            _resize(t, False)

    def add_grad(self, grad: torch.Tensor) -> None:
        """Collect the gradient of the unsharded parameter (summed over uses and backwards)."""
        if self.grad is None:
            self.grad = grad
        elif self.grad.dtype == grad.dtype:
            self.grad = self.grad + grad
        else:
            self.grad += grad


def make_shard(p: torch.Tensor, sp: ShardedParam) -> torch.Tensor:
    """This rank's rows of ``p`` in ``p``'s own class: a view of a padded shard the class made.

    Returns:
        shape ``sp.spec.local_shape``, the type of ``p`` (torch's FSDP2 builds it the same way).
    """
    spec = sp.spec
    with torch.no_grad():
        data = p.detach()
        padded = data.new_zeros((spec.chunk_rows, *spec.row_shape))
        if spec.local_rows:  # split, as torch.chunk: subclasses (NF4) may view or slice only from row 0
            rows = torch.split(data, spec.chunk_rows)[spec.rank] if data.dim() else spec.local_slice(data)
            padded.narrow(0, 0, spec.local_rows).copy_(rows)
        return padded.narrow(0, 0, spec.local_rows)
