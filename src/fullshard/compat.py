"""torch's private names, and the differences between torch versions: the one module that uses them.

fullshard lives outside torch and must survive its upgrades (torch 2.11 on the GPU machines, 2.13
here). Every private torch name fullshard touches is resolved here, behind a named function or
constant whose comment says why fullshard needs it and which public API would replace it;
``tools/check_layers.py`` flags a private torch access anywhere else, and
``tests/test_compat.py`` resolves every name in :data:`PRIVATE_NAMES` and fails naming the one a
torch lacks.

Names needed by the engine's core (storage swap, storage use count, version counters, the
autograd engine, the backward's task id, the c10d backend options) are resolved when this module
is imported: a torch without one fails at ``import fullshard`` with the name and the torch
version, never by switching a feature off. Names needed only by optional features (DTensor
internals, tensor parallelism, dynamo) are resolved when first used, because importing their
modules costs time in every process (``torch.distributed.tensor``: 0.7 s), and raise the same
error there. Where torch versions differ in public names, the choice is made here at import,
by presence, and recorded in a constant (:data:`ALL_GATHER_NAME`, :data:`STORE_ACCESSOR`,
:data:`STORAGE_SWAP`). nn.Module's registration dicts (``_parameters``, ...) are reached here too.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import profiler as _autograd_profiler
from torch.autograd.variable import Variable

__all__ = ["PRIVATE_NAMES", "BatchNormBase", "IncompatibleKeys", "MissingTorchName", "TorchDispatchMode"]
__all__ += ["resolve", "tree_flatten", "tree_map"]


class MissingTorchName(ImportError, RuntimeError):
    """This torch lacks a name fullshard needs: the message names it and the torch version.

    An ImportError (raised by ``import fullshard`` for the engine's names) and a RuntimeError (raised
    where an optional feature first needs its name, as fullshard's feature errors are)."""


def resolve(path: str) -> Any:
    """The object at ``path`` ("module:attr.attr", or "module" alone) in the running torch.

    Raises:
        MissingTorchName: the module or an attribute on the way does not exist in this torch.
    """
    module_name, _, attrs = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise MissingTorchName(f"fullshard needs {module_name}, absent in torch {torch.__version__}") from e
    for attr in filter(None, attrs.split(".")):
        if not hasattr(obj, attr):
            raise MissingTorchName(f"fullshard needs {path.replace(':', '.')}, absent in torch {torch.__version__}")
        obj = getattr(obj, attr)
    return obj


# Every private name used below, as resolve() paths: tests/test_compat.py resolves each one.
# Those marked "import" are resolved when this module is imported (the engine cannot run without
# them); "use" ones when the feature that needs them is first used; "optional" ones pick between
# two supported ways by presence (each with a test of both ways).
PRIVATE_NAMES: dict[str, str] = {
    "torch:UntypedStorage._swap_data_ptr_": "optional",  # absent in torch 2.11: see STORAGE_SWAP
    "torch:_C._storage_Use_Count": "import",
    "torch:_C._autograd._unsafe_set_version_counter": "import",
    "torch:_C._current_graph_task_id": "import",
    "torch:_C._will_engine_execute_node": "import",
    "torch.autograd.variable:Variable._execution_engine": "import",
    "torch.autograd.profiler:_is_profiler_enabled": "import",
    "torch:_foreach_norm": "import",
    "torch:_foreach_mul_": "import",
    "torch.utils._pytree:tree_map": "import",
    "torch.utils._pytree:tree_flatten": "import",
    "torch.utils._python_dispatch:TorchDispatchMode": "import",
    "torch.nn.modules.module:_IncompatibleKeys": "import",
    "torch.nn.modules.batchnorm:_BatchNorm": "import",
    "torch.distributed:ProcessGroup._get_backend": "import",
    "torch.distributed.tensor:DTensor": "use",  # its private constructor and _local_tensor / _spec
    "torch.distributed.tensor._dtensor_spec:DTensorSpec": "use",
    "torch.distributed.tensor._dtensor_spec:TensorMeta": "use",
    "torch.distributed.tensor._utils:compute_local_shape_and_global_offset": "use",
    "torch.distributed.tensor.placement_types:_StridedShard": "use",
    "torch.distributed.device_mesh:DeviceMesh._concatenate": "use",
    "torch.distributed._composable.fsdp:fully_shard": "use",
    "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard": "use",  # see torch_fsdp2_state
    "torch.distributed._shard.sharded_tensor:ShardedTensor": "use",
    "torch.distributed.distributed_c10d:_get_default_store": "use",  # only where get_group_store is absent
    "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu": "use",
    "torch:ops.aten._scaled_dot_product_flash_attention": "use",
    "torch:ops.aten._scaled_dot_product_efficient_attention": "use",
    "torch._dynamo:reset": "use",
    "torch._dynamo:disable": "use",  # when dynamo is imported (see fullshard.deferred_import)
    "torch._dynamo.eval_frame:skip_code": "use",
    "torch._dynamo.utils:counters": "use",
    "torch.distributed.fsdp.wrap:CustomPolicy": "use",  # the lambda_fn it keeps as _lambda_fn
    "torch.distributed.checkpoint.state_dict:FSDP": "use",  # see bind_dsd_fsdp
    "torch.distributed.checkpoint.state_dict:_get_module_fsdp_state_if_fully_sharded_module": "use",
}
for _path, _when in PRIVATE_NAMES.items():
    if _when == "import":
        resolve(_path)

# ---- imported by name after the check above (so type checkers see their types) --------------
# _IncompatibleKeys: what Module.load_state_dict returns; fullshard's returns the same (no public
# name). TorchDispatchMode: the planner's live-byte tracker (no public base class). pytree: module
# inputs and outputs (public torch.utils.pytree is announced, not in torch 2.13). _BatchNorm:
# the base of BatchNorm1d/2d/3d, their lazy forms and SyncBatchNorm, the default of torch FSDP1's
# MixedPrecision._module_classes_to_ignore, which fullshard's MixedPrecision shares (no public base).
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # noqa: E402
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

# ---- storages ------------------------------------------------------------------------------
# The buffer pool gives memory to a unit's flat buffer by swapping storage data pointers, so every
# view of the buffer sees the pooled memory. No public API moves memory between storages. torch
# 2.11 has no swap: there the flat buffer's storage is resized instead (public resize_, what CUDA
# always does), and CPU memory is not pooled for it. Chosen once, here.
_swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
STORAGE_SWAP = _swap is not None
# Whether a pooled buffer is still used by a view someone kept. No public use count of a storage.
_use_count = resolve("torch:_C._storage_Use_Count")


def swap_storage_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of storages ``a`` and ``b`` (each keeps its identity and views).

    Raises:
        MissingTorchName: this torch has no swap (check :data:`STORAGE_SWAP` first).
    """
    if _swap is None:
        raise MissingTorchName(
            f"fullshard needs torch.UntypedStorage._swap_data_ptr_, absent in torch {torch.__version__}"
        )
    _swap(a, b)


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors (and torch's own Python storage object) use ``t``'s storage."""
    return int(_use_count(t.untyped_storage()._cdata))


# ---- autograd ----------------------------------------------------------------------------------
# The use-after-reshard guard raises the version counters of freed full buffers so autograd
# refuses tensors saved from them. No public setter (Tensor._version is read-only).
_set_version_counter = resolve("torch:_C._autograd._unsafe_set_version_counter")
_current_graph_task_id = resolve("torch:_C._current_graph_task_id")
_will_execute = resolve("torch:_C._will_engine_execute_node")


def set_version_counters(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    """Set the autograd version counters of ``tensors`` (shared with their views) to ``versions``."""
    _set_version_counter(tensors, versions)


def version_counter(t: torch.Tensor) -> int:
    """``t``'s autograd version counter (bumped by every in-place op). Read-only ``Tensor._version``."""
    return int(t._version)


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The step hooks torch runs around ``optimizer.step()``, each list in its order: global
    pre-hooks, the optimizer's own pre-hooks, its own post-hooks, global post-hooks."""
    from torch.optim import optimizer as module

    return (
        list(module._global_optimizer_pre_hooks.values()),
        list(optimizer._optimizer_step_pre_hooks.values()),
        list(optimizer._optimizer_step_post_hooks.values()),
        list(module._global_optimizer_post_hooks.values()),
    )


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (``Tensor._base``, documented but underscored)."""
    return t._base is not None


def in_backward() -> bool:
    """Whether the autograd engine runs a backward pass on this thread now. Public replacement:
    none (FSDP2 reads the same task id)."""
    return bool(_current_graph_task_id() != -1)


def will_backward_run(node: Any) -> bool:
    """Whether the backward running now on this thread will run autograd node ``node``. Public
    replacement: none (``torch.autograd.graph.register_multi_grad_hook`` reads the same)."""
    return bool(_will_execute(node))


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass ends (autograd's engine callback queue; FSDP2
    queues its own end of backward the same way; no public API)."""
    Variable._execution_engine.queue_callback(fn)


def autograd_engine_type() -> type:
    """The class of autograd's engine handle (fullshard's guard subclasses it to name freed units
    in autograd's errors)."""
    return type(Variable._execution_engine)


def install_autograd_engine(engine_type: type) -> None:
    """Make an ``engine_type()`` (a subclass of :func:`autograd_engine_type`) autograd's engine
    handle, behind ``Tensor.backward`` and ``torch.autograd.grad``, unless one is already
    (idempotent). No public API: torch has no hook around a backward call that sees its errors."""
    if not isinstance(Variable._execution_engine, engine_type):
        Variable._execution_engine = engine_type()


def profiler_enabled() -> bool:
    """Whether torch.profiler (or the autograd profiler) records now; no public query."""
    return bool(_autograd_profiler._is_profiler_enabled)


# ---- foreach kernels -------------------------------------------------------------------------
# One multi-tensor kernel per (device, dtype) bucket, as torch.nn.utils.clip_grad_norm_ does.
# Public replacement: torch.nn.utils.get_total_norm / clip_grads_with_norm_ (they bucket by
# themselves and return float32 norms; fullshard sums per shard group in float64).
foreach_norm: Callable[..., Any] = resolve("torch:_foreach_norm")
foreach_mul_: Callable[..., Any] = resolve("torch:_foreach_mul_")

# ---- nn.Module's registration dicts --------------------------------------------------------
# Shards replace parameters in place, and full parameters are read without nn.Module's
# __getattr__ (whose instance-__dict__ shadowing fullshard uses). register_parameter refuses
# tensors that are not Parameters and runs global registration hooks; no public dict view.


def module_parameters(m: nn.Module) -> dict[str, Any]:
    """``m``'s own parameter slots (name -> Parameter or None), the live dict (writes register)."""
    return m._parameters  # type: ignore[return-value]


def module_buffers(m: nn.Module) -> dict[str, Any]:
    """``m``'s own buffer slots (name -> tensor or None), the live dict."""
    return m._buffers  # type: ignore[return-value]


def module_children(m: nn.Module) -> dict[str, Any]:
    """``m``'s direct submodules (name -> module or None), the live dict."""
    return m._modules  # type: ignore[return-value]


def non_persistent_buffers(m: nn.Module) -> set[str]:
    """Names of ``m``'s buffers left out of its state dict (``persistent=False``)."""
    return m._non_persistent_buffers_set


def forward_hooks(m: nn.Module) -> tuple[list[tuple[Any, bool]], list[Any]]:
    """``m``'s forward pre-hooks, each with whether it takes kwargs, and its forward hooks, in
    order (for running them around a method other than forward, as FSDP2's
    register_fsdp_forward_method does; torch has no public way to run them)."""
    pre = [(hook, key in m._forward_pre_hooks_with_kwargs) for key, hook in m._forward_pre_hooks.items()]
    return pre, list(m._forward_hooks.values())


def module_apply_after(cls: Any, m: Any, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module._apply`` (behind ``.to()``, ``.float()``) as resolved after ``cls`` in ``m``'s
    MRO: fullshard's FSDPModule subclass skips torch's FSDPModule._apply, which works on torch's state."""
    return super(cls, m)._apply(*args, **kwargs)


def fsdp_module_new_inits() -> bool:
    """Whether ``FSDP<Cls>(...)`` runs ``__init__``: torch's FSDPModule.__new__ reads a module
    flag that code rebuilding modules without __init__ (dynamo's packages) turns off. A torch
    whose FSDPModule has no such flag always initializes: then True, as its own __new__ does."""
    from torch.distributed.fsdp import FSDPModule

    module = sys.modules[FSDPModule.__new__.__module__]
    return bool(getattr(module, "_enable_fsdp_module_new_init", True))


# ---- process groups ------------------------------------------------------------------------
# The default group's store: public ProcessGroup.get_group_store() where torch has it, else c10d's
# private accessor (torch 2.11). Chosen once, here.
STORE_ACCESSOR = "get_group_store" if hasattr(dist.ProcessGroup, "get_group_store") else "_get_default_store"


def group_store(group: Any) -> Any:
    """The c10d store behind ``group`` (the default group): see :data:`STORE_ACCESSOR`."""
    if STORE_ACCESSOR == "get_group_store":
        return group.get_group_store()
    return resolve("torch.distributed.distributed_c10d:_get_default_store")()


def backend_timeout(group: Any, device: torch.device) -> float | None:
    """The ``timeout=`` (seconds) ``group``'s backend for ``device`` was created with, or None
    when that backend keeps no options (a third-party backend). torch has no public getter:
    ``init_process_group`` / ``new_group`` store it in the backend's options."""
    options = getattr(group._get_backend(device), "options", None)
    timeout = getattr(options, "_timeout", None)
    return None if timeout is None else float(timeout.total_seconds())


def first_present(owner: Any, *names: str) -> str:
    """The first of ``names`` that ``owner`` (a module or class) has: how a name torch renamed is
    chosen, newest first.

    Raises:
        MissingTorchName: ``owner`` has none of them.
    """
    for name in names:
        if hasattr(owner, name):
            return name
    raise MissingTorchName(
        f"fullshard needs one of {', '.join(names)} in {getattr(owner, '__name__', owner)}, "
        f"absent in torch {torch.__version__}"
    )


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single (public both); 2.11 has only the old names. Chosen once, here.
ALL_GATHER_NAME = first_present(dist, "all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_NAME = first_present(dist, "reduce_scatter_single", "reduce_scatter_tensor")
all_gather_tensor: Callable[..., Any] = getattr(dist, ALL_GATHER_NAME)
reduce_scatter_tensor: Callable[..., Any] = getattr(dist, REDUCE_SCATTER_NAME)


# ---- DTensor (resolved on first use: importing torch.distributed.tensor costs 0.7 s) ---------
# fully_shard registers DTensor parameters whose local tensor is a view into the unit's flat
# buffer, as FSDP2 does. DTensor.from_local would check and copy metadata on every call and
# goes through autograd; FSDP2 builds its DTensors from a spec the same private way.


def dtensor_local(t: Any) -> torch.Tensor:
    """The local tensor of DTensor ``t``, itself (not a copy, no autograd: ``to_local()`` would
    record an autograd op)."""
    return t._local_tensor  # type: ignore[no-any-return]


def set_dtensor_local(t: Any, local: torch.Tensor) -> None:
    """Make ``local`` the local tensor of DTensor ``t`` (same shape and dtype; no public setter)."""
    t._local_tensor = local


def dtensor_spec(t: Any) -> Any:
    """DTensor ``t``'s DTensorSpec (mesh, placements, global shape, stride, dtype)."""
    return t._spec


def make_dtensor_spec(mesh: Any, placements: tuple[Any, ...], shape: Any, stride: Any, dtype: torch.dtype) -> Any:
    """A DTensorSpec of global ``shape`` / ``stride`` / ``dtype`` on ``mesh`` with ``placements``
    (``torch.distributed.tensor._dtensor_spec``: no public constructor)."""
    spec_cls = resolve("torch.distributed.tensor._dtensor_spec:DTensorSpec")
    meta_cls = resolve("torch.distributed.tensor._dtensor_spec:TensorMeta")
    return spec_cls(mesh, tuple(placements), tensor_meta=meta_cls(shape, stride, dtype))


def dtensor_from_spec(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor not requiring grad, with local tensor ``local`` and ``spec`` (DTensor's
    constructor: ``from_local`` would run through autograd and check the shapes again)."""
    return resolve("torch.distributed.tensor:DTensor")(local, spec, requires_grad=False)


def strided_shard(dim: int, split_factor: int) -> Any:
    """torch's ``_StridedShard(dim, split_factor=...)`` placement: FSDP over a dim TP already
    splits (FSDP2 uses the same private placement for the 2-D case)."""
    return resolve("torch.distributed.tensor.placement_types:_StridedShard")(dim, split_factor=split_factor)


def local_shape_and_offset(shape: Any, mesh: Any, placements: Any) -> tuple[Any, Any]:
    """This rank's local shape and global offset of a DTensor of global ``shape`` placed so."""
    compute = resolve("torch.distributed.tensor._utils:compute_local_shape_and_global_offset")
    return compute(shape, mesh, placements)  # type: ignore[no-any-return]


def concatenate_meshes_fn() -> Callable[[list[Any]], Any]:
    """The function that makes one device mesh with ``meshes`` (dimensions of one root mesh) as its
    dimensions, in order: the 2-D (dp, tp) mesh of a TP parameter (``DeviceMesh._concatenate``:
    no public one).

    Raises:
        MissingTorchName: this torch has no ``DeviceMesh._concatenate``.
    """
    return resolve("torch.distributed.device_mesh:DeviceMesh._concatenate")  # type: ignore[no-any-return]


# ---- FSDP names frameworks import ------------------------------------------------------------
# torch's old FSDP2 path, which frameworks still import: use_in_torch rebinds it too.
COMPOSABLE_FSDP = "torch.distributed._composable.fsdp"


def import_composable_fsdp() -> Any:
    """Import ``torch.distributed._composable.fsdp`` (and its ``fully_shard`` module)."""
    resolve(f"{COMPOSABLE_FSDP}:fully_shard")
    return sys.modules[COMPOSABLE_FSDP]


def torch_fsdp2_state(module: nn.Module) -> Any:
    """torch's ``fully_shard.state(module)``: its own FSDP2 state of ``module``, or None. Read
    from the private module torch defines the function in, since ``use_in_torch`` may have
    rebound every public name of it to fullshard's."""
    return resolve("torch.distributed.fsdp._fully_shard._fully_shard:fully_shard").state(module)


def is_torch_custom_policy(value: Any) -> bool:
    """Whether ``value`` is torch's ``torch.distributed.fsdp.wrap.CustomPolicy`` (checked
    without importing the module when nothing loaded it)."""
    module = sys.modules.get("torch.distributed.fsdp.wrap")
    return module is not None and isinstance(value, getattr(module, "CustomPolicy", ()))


def custom_policy_fn(policy: Any) -> Callable[[nn.Module], Any]:
    """The ``lambda_fn`` a torch ``CustomPolicy`` was built with (it keeps it privately)."""
    return policy._lambda_fn


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is torch FSDP1's ShardedTensor (what load_sharded_optimizer_state_dict
    returns). Its private module is loaded only when one exists, so it is not imported here."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return module is not None and isinstance(value, module.ShardedTensor)


_DSD_NAMES = ("FSDP", "_get_module_fsdp_state_if_fully_sharded_module")
_dsd_torch: dict[str, Any] = {}  # torch's objects under _DSD_NAMES, kept by bind_dsd_fsdp


def bind_dsd_fsdp(stand_in: type, fully_sharded_state: Callable[[nn.Module], Any]) -> None:
    """In ``torch.distributed.checkpoint.state_dict``, replace torch's FSDP1 class (bound there
    as ``FSDP``) with ``stand_in`` and its private ``_get_module_fsdp_state_if_fully_sharded_module``
    with ``fully_sharded_state``. That module finds FSDP1 modules only through these two names and
    has no public hook for another implementation. Idempotent; torch's originals stay reachable
    (:func:`dsd_torch_fully_sharded_state`)."""
    module = sys.modules["torch.distributed.checkpoint.state_dict"]
    if not _dsd_torch:
        _dsd_torch.update({name: getattr(module, name) for name in _DSD_NAMES})
    module.FSDP = stand_in  # type: ignore[attr-defined]
    module._get_module_fsdp_state_if_fully_sharded_module = fully_sharded_state  # type: ignore[attr-defined]


def dsd_torch_fully_sharded_state(module: nn.Module) -> Any:
    """torch's ``_get_module_fsdp_state_if_fully_sharded_module`` (as kept by :func:`bind_dsd_fsdp`)."""
    return _dsd_torch["_get_module_fsdp_state_if_fully_sharded_module"](module)


# ---- dynamo and aten (benchmarks and the planner) --------------------------------------------


DYNAMO = "torch._dynamo"
"""dynamo's module (private: torch has no public module for it); importing it takes 2.6 s here."""


def dynamo_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped so that it and everything it calls run eagerly, never traced by dynamo
    (``torch._dynamo.disable``, recursive; the public ``torch.compiler.disable`` is the same
    wrapper, but importing this module is what costs: call it only once dynamo is imported)."""
    return resolve("torch._dynamo:disable")(fn, recursive=True, reason="fullshard's FSDP hooks run eagerly")


def dynamo_skip_frames_of(code: Any) -> None:
    """Make dynamo run every frame of ``code`` (a code object) as it is, never compiling it; the
    frames it calls are still dynamo's to decide (``torch._dynamo.eval_frame.skip_code``; no
    public equivalent: ``torch.compiler.disable`` marks one function object, not a code object
    that many closures share)."""
    resolve("torch._dynamo.eval_frame:skip_code")(code)


def compiled_autograd_on() -> bool:
    """Whether a backward runs through compiled autograd now: while it traces the autograd graph
    (inside ``compiled_autograd._enable``, which ``torch._dynamo.config.compiled_autograd`` enters
    around compiled frames) or runs the graph it compiled (which turns the first flag off while it
    runs, and calls tensor hooks from there). Never imports dynamo: off until something did."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    flags = ("compiled_autograd_enabled", "in_compiled_autograd_region")
    return any(bool(getattr(module, flag, False)) for flag in flags)


def dynamo_reset() -> None:
    """Forget every compiled graph (``torch._dynamo.reset``; ``torch.compiler.reset`` is the
    public spelling in newer torch, the same function)."""
    resolve("torch._dynamo:reset")()


def dynamo_graph_breaks() -> int:
    """Graph breaks dynamo counted in this process (no public counter)."""
    return sum(resolve("torch._dynamo.utils:counters")["graph_break"].values())


def sdpa_kernels() -> dict[str, Any]:
    """aten's fused attention kernels by name (``flash_cpu``, ``flash``, ``efficient``): the
    planner calls them on meta tensors and saves their outputs in selective checkpointing."""
    aten = torch.ops.aten
    return {
        "flash_cpu": aten._scaled_dot_product_flash_attention_for_cpu,
        "flash": aten._scaled_dot_product_flash_attention,
        "efficient": aten._scaled_dot_product_efficient_attention,
    }


def torch_activation_checkpointing() -> tuple[Callable[..., None], Callable[..., nn.Module]]:
    """torch's own ``apply_activation_checkpointing`` and ``checkpoint_wrapper`` (a private module
    of torch's), for running torch's FSDP with the checkpointing fullshard's front end applies."""
    module = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
    return resolve(f"{module}:apply_activation_checkpointing"), resolve(f"{module}:checkpoint_wrapper")
