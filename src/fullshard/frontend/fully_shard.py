"""``fully_shard``: torch FSDP2's composable API on fullshard's engine.

``fully_shard(module)`` makes ``module`` an FSDP unit in place, without a wrapper: its class
becomes a subclass of both :class:`FSDPModule` and its own class, and forward hooks gather and
free its parameters. Apply it bottom-up (each transformer block, then the whole model); each
call owns the parameters no earlier call took. Parameter names do not change.

As in torch's FSDP2, every parameter is then a ``DTensor`` of its full shape, placed
``Shard(0)`` on the unit's mesh (``(Replicate(), Shard(0))`` on a 2-D mesh for hybrid
sharding; ``Shard(d)`` where ``shard_placement_fn`` chooses dim d), whose local tensor is this
rank's rows (torch.chunk layout along the dim, possibly 0 rows), a view into the unit's local
flat buffer. So are the gradients after backward and the values of
``state_dict()``. torch's tools built on DTensor work on them as they are:
``torch.nn.utils.clip_grad_norm_`` returns the global norm, ``full_tensor()`` the full value,
the ``torch.distributed.checkpoint.state_dict`` functions save and load full and sharded
state, and optimizers keep DTensor state.

The mesh may be a slice of a bigger one (``mesh["dp_replicate", "dp_shard"]`` or ``mesh["dp"]``
beside a pipeline dimension): each unit shards and replicates over the slice's ranks only.

Parameters that are already DTensors on a 1-D tensor-parallel mesh (after
``parallelize_module(..., mesh["tp"], ...)``, then ``fully_shard(..., mesh=mesh["dp"])``, or
``mesh=mesh["dp_replicate", "dp_shard"]`` for hybrid sharding) are sharded over dp through their
local tensors and registered on the (dp, tp) mesh, 2-D or 3-D, as torch's: see
:mod:`.tensor_parallel`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from fullshard import compat
from fullshard.comm import collectives
from fullshard.compat import tree_map
from fullshard.engine import all_gather_extension, build, dynamo_guard, frozen_backward, hooks, inference_guard
from fullshard.engine.config import BackwardPrefetch, CommQuantization, FrontEnd, MixedPrecision, ShardingStrategy
from fullshard.engine.groups import resolve_groups
from fullshard.engine.shard_sync import register_dtensors
from fullshard.engine.sharded_param import is_sharded, unshifted
from fullshard.engine.unit import ShardState, TrainingState, Unit
from fullshard.frontend import meshes, optim_local, pipelining, shard_dims, tensor_parallel
from fullshard.frontend.fsdp_module import FSDPModule
from fullshard.frontend.options import as_comm_quantization, as_mp_policy, as_offload_policy


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision: gather and compute in ``param_dtype``, reduce in ``reduce_dtype``,
    cast floating-point outputs to ``output_dtype`` and inputs to ``param_dtype``."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(
                    f"MixedPrecisionPolicy.{name}={value!r} is not a floating-point torch.dtype; use "
                    "torch.bfloat16, torch.float16 or torch.float32 (or None to keep the original)"
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be True or False, got {self.cast_forward_inputs!r}"
            )


class OffloadPolicy:
    """No offloading (the base of CPUOffloadPolicy)."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards and gradients in CPU memory (pinned when ``pin_memory``); step there."""

    pin_memory: bool = True


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[Any] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload_policy: Optional[OffloadPolicy] = None,
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    comm_quantization: Optional[CommQuantization] = None,
    dp_mesh_dims: Optional[Any] = None,
) -> Any:
    """Shard ``module``'s parameters (those no earlier ``fully_shard`` took) over ``mesh``.

    Each parameter of shape (d0, *rest) becomes a DTensor of that shape (placement Shard(0))
    whose local tensor holds this rank's ceil(d0 / N)-row chunk (for Shard(d): this rank's
    ``torch.chunk`` of dim d, contiguous); on the meta device it stays
    there (call ``module.to_empty(device=...)`` and initialize, or load a state dict with
    ``assign=True``; the values are taken into the unit at the first forward).

    Args:
        module: the module, or a list of modules sharded together as one unit (gathered at
            the first of their forwards, freed after the last); changed in place and returned.
        mesh: a 1-D DeviceMesh to shard over, a 2-D one (replicate, shard) for hybrid
            sharding, or None for the whole world (on the accelerator if there is one). It may
            be a slice of a bigger mesh (``mesh3["dp_replicate", "dp_shard"]`` beside "pp" or
            "tp"); tensor-parallel DTensor parameters must be on another dimension of the same
            mesh.
        reshard_after_forward: free the full parameters after forward; an int M keeps 1/M of
            them so backward gathers within M ranks. None (the default): True, except that the
            root keeps them for backward; given explicitly, the root follows it too (torch >=
            2.8's rule: a model with several roots frees each after its forward); see
            :func:`~fullshard.frontend.meshes.as_reshard_after_forward`.
        shard_placement_fn: called with each parameter; returns ``Shard(d)`` to shard it along
            dim d (negative d counted from the end; the size of dim d need not divide N: the
            last ranks hold fewer rows, as DTensor lays them out) or None for ``Shard(0)``.
        mp_policy: a MixedPrecisionPolicy (fullshard's or torch.distributed.fsdp's).
        offload_policy: CPUOffloadPolicy() to keep shards in CPU memory (GPU runs); fullshard's
            or torch.distributed.fsdp's.
        ignored_params: parameters to leave unsharded, unreduced and where they are.
        comm_quantization: fullshard's own: a :class:`~fullshard.CommQuantization` to
            all-gather this unit's parameters as int8 blocks and/or reduce-scatter its gradients
            in bf16 or int8 (None: exact communication, as torch's). Each call sets its own
            unit's; pass the same to every call for the whole model.
        dp_mesh_dims: torch 2.13's (:class:`~fullshard.frontend.meshes.DataParallelMeshDims`):
            only None; pass the data-parallel slice of the mesh as ``mesh`` instead.

    Returns:
        ``module``, now also an FSDPModule (the list, for a list).

    Raises:
        TypeError: a policy of a type neither fullshard's nor torch's; a mesh not a DeviceMesh.
        ValueError: ``module`` already heads a unit; it or a submodule was sharded by torch's
            FSDP or is a fullshard FullyShardedDataParallel; a mesh of more than 2 dimensions; a 0-dim
            parameter (as torch's fully_shard: make it shape (1,) or ignore it); a parameter
            defining only one of fsdp_pre_all_gather / fsdp_post_all_gather; ``shard_placement_fn``
            returning Shard(d) with d out of range for the parameter.
        NotImplementedError: a placement other than Shard(d) or None; Shard(d > 0) for a
            tensor-parallel or tensor-subclass parameter; a tensor-subclass parameter
            without the all-gather extension (with it, its hooks decide what is gathered);
            ``dp_mesh_dims`` not None.
        RuntimeError: no process group is initialized.
    """
    meshes.refuse_dp_mesh_dims(dp_mesh_dims)
    modules = _modules(module)
    quant = as_comm_quantization(comm_quantization, "fully_shard")
    mp_policy = as_mp_policy(mp_policy, MixedPrecisionPolicy)
    offload_policy = as_offload_policy(offload_policy, OffloadPolicy, CPUOffloadPolicy)
    _check_fresh(modules, mesh)
    ignored = _mark_ignored(ignored_params)
    if mesh is None:
        mesh = meshes.default_mesh("cuda" if torch.cuda.is_available() else "cpu")
    mp = _engine_mp(mp_policy)
    holder = modules[0] if len(modules) == 1 else _ModuleGroup(modules)
    unit = _build(holder, mesh, mp, offload_policy, reshard_after_forward, shard_placement_fn, quant)
    all_gather_extension.attach(unit, mesh, mp_policy)  # tensor subclasses with fsdp_pre_all_gather
    optim_local.install()  # optimizer steps run on the local tensors (same bits, no DTensor dispatch)
    _make_units(modules, unit, mp, mp_policy.output_dtype if mp_policy else None, ignored)
    return module


# As torch's: ``fully_shard.state(module)``, which torch's pipeline stage reads at REDUCE_GRAD.
fully_shard.state = pipelining.state  # type: ignore[attr-defined]


def _mark_ignored(ignored_params: Any) -> Optional[set[nn.Parameter]]:
    """Mark ``ignored_params`` as left out of every unit; returns them as a set (read once: it
    may be a generator), or None when not given.

    Raises:
        TypeError: one tensor or module instead of an iterable, or an entry that is not a parameter
            (a module's parameters were sharded without a word).
    """
    if ignored_params is None:
        return None
    if isinstance(ignored_params, (torch.Tensor, nn.Module)):
        raise TypeError(
            f"fully_shard: ignored_params must be an iterable of parameters, got one "
            f"{type(ignored_params).__name__}; pass ignored_params={{param}}"
        )
    ignored = set(ignored_params)
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            fix = "pass its parameters: set(module.parameters())" if isinstance(p, nn.Module) else "pass parameters"
            raise TypeError(f"fully_shard: ignored_params must hold parameters, got {type(p).__name__}; {fix}")
    for p in ignored:
        p._fullshard_ignored = True  # type: ignore[attr-defined]
    return ignored


def _engine_mp(mp_policy: Optional[MixedPrecisionPolicy]) -> Optional[MixedPrecision]:
    """The engine's MixedPrecision for an FSDP2 policy (``output_dtype`` is the forward hooks')."""
    if mp_policy is None:
        return None
    cast = mp_policy.cast_forward_inputs  # FSDP2's flag covers every unit, the root's included
    return MixedPrecision(
        mp_policy.param_dtype, mp_policy.reduce_dtype, cast_forward_inputs=cast, cast_root_forward_inputs=cast
    )


def _check_fresh(modules: list[nn.Module], mesh: Any) -> None:
    """Refuse a module that already heads a unit, a mesh that is not a DeviceMesh, and one of
    other than 1 or 2 dimensions."""
    meshes.check_mesh(mesh, "fully_shard: mesh")
    for m in modules:
        if hooks.is_unit(m):
            raise ValueError(
                f"{type(m).__name__} is already sharded (fully_shard or FullyShardedDataParallel); apply it once"
            )
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh must have 1 or 2 dimensions (shard, or replicate and shard), got {mesh.ndim} "
            f"({mesh.mesh_dim_names or 'unnamed'}): pass its data-parallel slice, e.g. "
            "mesh=mesh['dp_replicate', 'dp_shard'] or mesh=mesh['dp'], and parallelize tensor-parallel layers "
            "over mesh['tp'] first"
        )


def _make_units(
    modules: list[nn.Module],
    unit: Unit,
    mp: Optional[MixedPrecision],
    output_dtype: Optional[torch.dtype],
    ignored_params: Optional[set[nn.Parameter]],
) -> None:
    """Give ``modules`` the unit's FSDP state, forward and state-dict hooks, and FSDPModule's
    methods; mark the modules they manage as torch's (``build.mark_managed``: transformers'
    ``generate`` keeps ranks in step on it)."""
    state = hooks.FSDPState(
        unit, FrontEnd.FULLY_SHARD, mixed_precision=mp, backward_prefetch=BackwardPrefetch.BACKWARD_PRE
    )
    _register_forward_hooks(modules, state, output_dtype)
    for m in modules:
        hooks.set_fsdp_state(m, state)
        _register_state_dict_hooks(m, unit)
        m.__class__ = _fsdp_class(type(m))
        build.mark_managed(m, ignored_params=ignored_params)


def _modules(module: Union[nn.Module, list[nn.Module]]) -> list[nn.Module]:
    """``fully_shard``'s ``module`` as a list, none of it sharded by torch or the FSDP1 wrapper.

    Raises:
        TypeError: an entry that is not an nn.Module.
        ValueError: an empty list; a module already sharded elsewhere, or by a parent's fully_shard.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard: module is an empty list; pass a module or a non-empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard: module must be an nn.Module or a list of them, got {type(m).__name__} {m!r}; "
                "pass the model or one of its submodules"
            )
        build.check_not_sharded_elsewhere(m, FrontEnd.FULLY_SHARD)
        _check_not_inside_a_unit(m)
    return modules


def _check_not_inside_a_unit(module: nn.Module) -> None:
    """Refuse a module whose parameters an earlier ``fully_shard`` of a module containing it
    sharded (it holds no unit of its own that could have: the parent came first).

    Raises:
        ValueError: naming the parameters and the order to apply ``fully_shard`` in.
    """
    if any(hooks.is_unit(m) for m in module.modules()):  # modules() starts with module itself
        return
    taken = [n for n, p in module.named_parameters() if is_sharded(p)]
    if taken:
        raise ValueError(
            f"fully_shard: the parameters of this {type(module).__name__} ({', '.join(taken[:4])}) are already "
            "sharded by an earlier fully_shard of a module that contains it: apply fully_shard bottom-up, to "
            "submodules first and then to their parents (the root last)"
        )


def _build(
    holder: nn.Module,
    mesh: Any,
    mp: Optional[MixedPrecision],
    offload_policy: Optional[OffloadPolicy],
    reshard_after_forward: Union[bool, int, None],
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]],
    comm_quantization: Optional[CommQuantization] = None,
) -> Unit:
    """The unit of ``holder`` over ``mesh``, its parameters registered as DTensors."""
    from torch.distributed.tensor import Replicate, Shard

    hybrid = mesh.ndim == 2
    groups = resolve_groups(None, mesh, ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    tensor_parallel.take_tp_params(holder, mesh)  # TP DTensors: shard their local tensors over dp
    prepared = build.prepare(holder, meshes.mesh_device(mesh), offload, frozenset())
    if isinstance(offload_policy, CPUOffloadPolicy) and not offload_policy.pin_memory and prepared.device.type != "cpu":
        warnings.warn(
            "fully_shard: CPUOffloadPolicy(pin_memory=False) is not used: fullshard keeps offloaded shards and "
            "gradients in pinned CPU memory whenever CUDA is available",
            UserWarning,
            stacklevel=3,
        )
    shard_dims.mark(holder, shard_placement_fn)
    shard_size = collectives.group_size(groups.shard) if groups.shard is not None else 1
    reshard, post_forward_size = meshes.as_reshard_after_forward(reshard_after_forward, shard_size)
    config = build.unit_config(prepared.device, reshard, mp, offload, comm_quantization=comm_quantization)
    unit = build.build_unit(holder, prepared, groups, config, materialize_meta=False)
    unit.grads.upcast_unsynced = True  # torch FSDP2 sums unsynced gradients in the reduce dtype
    unit.grads.zero_grad_drops_unsynced = False  # and keeps them through zero_grad
    unit.grads.unused_grads_none = True  # and leaves a parameter no backward reached with .grad None
    unit.auto_reshard_after_forward = reshard_after_forward is None  # as the root: keep after forward
    if post_forward_size is not None:
        unit.set_post_forward_group(meshes.post_forward_group(mesh, post_forward_size))
    placements = [Replicate(), Shard(0)] if hybrid else [Shard(0)]
    specs = tensor_parallel.spmd_specs(unit, mesh)
    for sp in unit.dim_params:  # shard_placement_fn's Shard(d), d > 0
        shape = sp.spec.orig_shape
        on_dim = (*placements[:-1], Shard(sp.spec.dim))
        stride = torch.empty(shape, device="meta").stride()
        specs[sp.fqn] = compat.make_dtensor_spec(mesh, on_dim, shape, stride, unit.dtype)
    register_dtensors(unit, mesh, placements, specs)
    return unit


class _ModuleGroup(nn.Module):
    """Several modules seen as one tree while ``fully_shard`` builds their shared unit."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)


def _register_forward_hooks(
    modules: list[nn.Module], state: hooks.FSDPState, output_dtype: Optional[torch.dtype]
) -> None:
    """Gather before the first of ``modules`` runs forward and free after the last one has.

    A pass over the unit starts when a member runs while none is pending and ends when every
    member has run once (``state.modules_to_run``); the root's forward finishes a pass that some
    member never joined. A member run again within a pass (a chunked loss calling the head once
    per chunk, after an explicit ``unshard()``), or after a backward inside the pass, runs on the
    full parameters again, and each of its outputs is hooked so backward gathers the unit before
    reading them.
    """
    ids = {id(m) for m in modules}
    to_run = state.modules_to_run

    def recomputing() -> bool:
        # Activation checkpointing recomputes one member's forward inside the unit's backward.
        # torch's non-reentrant checkpoint stops a recomputation as soon as it has the tensors
        # backward needs, skipping the forward hook, so a recomputation must not count towards
        # the pass's bookkeeping.
        return state.unit.training_state is TrainingState.PRE_BACKWARD

    def abandoned(module: nn.Module) -> bool:
        # The root called again while its last call has not returned: no module calls itself,
        # so that call raised (a registered method calls forward inside its own pass).
        return (
            state.is_root
            and id(module) in to_run
            and state.unit.training_state is TrainingState.FORWARD
            and not state.methods_running
        )

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hooks.lazy_init(module)
        args, kwargs = hooks.prepare_inputs(state, (args, kwargs))
        if recomputing():
            hooks.pre_forward(state)
            return args, kwargs
        if state.is_root:
            optim_local.finish_failed_steps()  # before its backward can accumulate into their gradients
        if not to_run:
            to_run.update(ids)
        elif abandoned(module):
            # The root's last forward raised: its pass never ended, and its units may hold full
            # parameters gathered before an optimizer step since. The root's pre-forward tidies
            # every unit (back to SHARDED and IDLE) before this pass gathers afresh.
            state.unit.training_state = TrainingState.IDLE
            to_run.clear()
            to_run.update(ids)
        if state.unit.training_state is not TrainingState.FORWARD:
            hooks.pre_forward(state)
        return frozen_backward.hook_frozen_inputs(state, (args, kwargs))

    @inference_guard.outside_inference_mode  # what it allocates is kept: normal tensors
    def end(module: nn.Module, output: Any) -> Any:
        if recomputing():
            output = hooks.post_forward(state, output)
        elif state.methods_running:  # a forward inside a registered method: the method ends the pass
            if torch.is_grad_enabled():
                output = hooks.register_pre_backward(state, output)
        elif id(module) in to_run and len(to_run) == 1:
            to_run.clear()
            output = hooks.post_forward(state, output)
        else:
            to_run.discard(id(module))
            if torch.is_grad_enabled():
                output = hooks.register_pre_backward(state, output)
        return output

    def post(module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_output(end(module, output), output_dtype)  # in the caller's mode

    pre = dynamo_guard.outside_dynamo(inference_guard.outside_inference_mode(pre))  # never traced by compile
    post = dynamo_guard.outside_dynamo(post)
    for m in modules:
        m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        m.register_forward_hook(post)


def share_comm_ctx(modules: list[Any]) -> None:
    """torch's ``share_comm_ctx``: let several roots (pipeline stages' model chunks) share their
    communication streams. fullshard runs every collective on the current stream, so they share
    it already: this checks the modules and changes nothing.

    Raises:
        ValueError: an element that ``fully_shard`` did not shard (as torch's).
    """
    for m in modules:
        if not (isinstance(m, nn.Module) and hooks.is_unit(m) and isinstance(m, FSDPModule)):
            raise ValueError(f"share_comm_ctx expects a list of FSDPModules (given to fully_shard), got {m!r}")


def _cast_output(output: Any, dtype: Optional[torch.dtype]) -> Any:
    """``output``'s floating-point tensors cast to ``dtype`` (``mp_policy.output_dtype``), if given."""
    if dtype is None:
        return output
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)


def _register_state_dict_hooks(module: nn.Module, unit: Unit) -> None:
    """``load_state_dict`` also takes full tensors (and DTensors of any placement): each becomes
    this rank's rows as a DTensor like the parameter, so ``param.copy_`` (or ``assign=True``,
    taken into the unit at the next forward) works. ``state_dict`` gives DTensors whose wrapper
    sits at storage offset 0 (:func:`unshifted`: ``detach`` of a shard viewing the flat buffer
    at an offset does not, and ``async_save`` fails on it): every DTensor under the module's
    prefix, whatever its key, as wrappers' own post hooks may have renamed the keys already
    (``checkpoint_wrapper`` strips ``_checkpoint_wrapped_module.``)."""
    from torch.distributed.tensor import DTensor

    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    keys = [
        (sp, f"{names[id(slot.module)]}.{slot.attr}".lstrip("."))
        for sp in unit.params
        for slot in sp.slots
        if id(slot.module) in names
    ]

    def from_full(m: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        _reshard_kept(unit)
        for sp, rel in keys:
            value = state_dict.get(prefix + rel)
            if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                continue
            if sp.tp_spec is not None and value.shape == sp.tp_spec.shape:
                value = tensor_parallel.tp_local(sp, value)
            if value.shape == sp.spec.orig_shape:
                value = sp.spec.local_slice(value).reshape(sp.spec.local_shape)
            if value.shape == sp.spec.local_shape:
                state_dict[prefix + rel] = sp.as_registered(value.to(sp.local.device))

    module.register_load_state_dict_pre_hook(from_full)

    def unshift(m: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for key, value in state_dict.items():
            if isinstance(value, DTensor) and key.startswith(prefix):
                state_dict[key] = unshifted(value)

    module.register_state_dict_pre_hook(lambda *args: _reshard_kept(unit))
    module.register_state_dict_post_hook(unshift)


def _reshard_kept(unit: Unit) -> None:
    """Free the full parameters of a unit kept gathered between steps, as torch's does when its
    state dict is taken or loaded: the next forward gathers the shards' current values (after a
    load the loaded ones, not those gathered before). Not while a forward's backward is pending."""
    idle = unit.training_state is TrainingState.IDLE and not unit._open_splits and not compat.in_backward()
    if idle and unit.shard_state is ShardState.UNSHARDED:
        unit.reshard()
