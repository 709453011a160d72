"""Building FSDP units from modules: devices, parameter ownership, initialization.

Both front ends (``FullyShardedDataParallel`` and ``fully_shard``) call :func:`prepare` on the
module before wrapping its children, then :func:`build_unit` for the parameters that are left
(the wrapper through :func:`build_wrapper_unit`, which reads its :class:`WrapperConfig`).
A module that already heads a unit carries its FSDP state (:func:`~fullshard.engine.hooks.fsdp_state`),
so the walks here stop at nested units of either front end.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import nn

from fullshard import compat
from fullshard.comm import collectives
from fullshard.engine.all_gather_extension import check_plain, unit_class
from fullshard.engine.config import CommQuantization, FrontEnd, MixedPrecision
from fullshard.engine.groups import Groups
from fullshard.engine.hooks import fsdp_state, is_unit
from fullshard.engine.meta_init import breadth_first, is_meta, materialize, own_tensors
from fullshard.engine.module_wrapper import clean_name
from fullshard.engine.sharded_param import ParamSlot, is_sharded
from fullshard.engine.unit import Unit, UnitConfig
from fullshard.engine.unit_check import first_difference, per_rank
from fullshard.engine.wrapper_config import WrapperConfig

ParamEntry = tuple[str, nn.Parameter, list[ParamSlot]]
Modules = AbstractSet[nn.Module]  # a set or frozenset of modules


_ONE_FRONT_END = (
    "FullyShardedDataParallel and fully_shard cannot be mixed in one model: use one of them for "
    "the whole model (fully_shard on each block and then on the root, or FullyShardedDataParallel "
    "on the root with an auto_wrap_policy for the blocks)"
)


def check_not_sharded_elsewhere(module: nn.Module, front_end: FrontEnd) -> None:
    """Refuse a tree that torch's FSDP, or fullshard's other front end, has already sharded.

    Runs before any collective, so every rank raises the same error.

    Args:
        module: the module about to be wrapped or given to ``fully_shard``.
        front_end: the caller.

    Raises:
        ValueError: ``module`` or a submodule is torch's FullyShardedDataParallel or a module
            torch's ``fully_shard`` sharded, or a unit of fullshard's other front end.
    """
    torch_fsdp = sys.modules.get("torch.distributed.fsdp")  # torch's FSDP objects exist only once it is loaded
    for name, m in module.named_modules():
        where = f"submodule {clean_name(name)!r} ({type(m).__name__})" if name else f"module ({type(m).__name__})"
        state = fsdp_state(m)
        # fullshard's units pass torch's isinstance checks (FSDPModule always, FullyShardedDataParallel
        # under use_in_torch(fsdp1=True)); torch's carry no fullshard FSDP state
        if torch_fsdp is not None and isinstance(m, torch_fsdp.FullyShardedDataParallel) and state is None:
            raise ValueError(
                f"{where} is already wrapped by torch.distributed.fsdp.FullyShardedDataParallel, so "
                f"fullshard's {front_end.value} cannot shard it: build the model without torch's wrapper and "
                "import FullyShardedDataParallel from fullshard instead of torch.distributed.fsdp"
            )
        if torch_fsdp is not None and isinstance(m, torch_fsdp.FSDPModule) and state is None:
            raise ValueError(
                f"{where} was already sharded by torch.distributed.fsdp.fully_shard, so fullshard's "
                f"{front_end.value} cannot shard it: build the model afresh and import fully_shard from "
                "fullshard instead of torch.distributed.fsdp for every call"
            )
        if state is not None and state.front_end is not front_end:
            other = (
                "a fullshard FullyShardedDataParallel"
                if state.front_end is FrontEnd.WRAPPER
                else "sharded by fullshard's fully_shard"
            )
            raise ValueError(f"{where} is {other}; {_ONE_FRONT_END}")


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` found out about a module before its children are wrapped."""

    device: torch.device
    meta: bool
    ignored: Modules


def prepare(
    module: nn.Module,
    device_id: Any,
    offload: bool,
    ignored: Modules,
) -> Prepared:
    """Choose the compute device and, unless the module is on the meta device, move it there.

    Raises:
        ValueError: parameters on several devices, or on another GPU than ``device_id``.
    """
    device = _compute_device(module, device_id, offload, ignored)
    meta = is_meta(module.modules())
    if not meta:
        _place(module, device, offload, ignored)
        _check_one_device(module, ignored)
    return Prepared(device, meta, ignored)


def build_wrapper_unit(module: nn.Module, prepared: Prepared, config: WrapperConfig, exclude: AbstractSet[int]) -> Unit:
    """The unit of one ``FullyShardedDataParallel``, built as ``config`` says (see :func:`build_unit`).

    Keeps the original Parameter objects registered (torch FSDP1's ``use_orig_params``), so an
    optimizer built before wrapping trains the model.
    """
    settings = unit_config(
        prepared.device,
        config.reshard_after_forward,
        config.mixed_precision,
        config.offload_params,
        keep_param_objects=True,
        comm_quantization=config.comm_quantization,
    )
    return build_unit(
        module,
        prepared,
        config.groups,
        settings,
        exclude,
        param_init_fn=config.param_init_fn,
        sync_module_states=config.sync_module_states,
        buffer_dtype=config.buffer_dtype,
    )


def build_unit(
    module: nn.Module,
    prepared: Prepared,
    groups: Groups,
    config: UnitConfig,
    exclude: AbstractSet[int] = frozenset(),
    *,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    buffer_dtype: torch.dtype | None = None,
    materialize_meta: bool = True,
) -> Unit:
    """The unit of ``module``: the parameters no nested unit owns, materialized and sharded.

    ``exclude``: ids of parameters an ancestor owns (shared beyond ``module``). Meta parameters
    are materialized on the compute device and initialized by ``param_init_fn`` (else their
    modules' ``reset_parameters()``); with ``materialize_meta=False`` (``fully_shard``) they stay
    on the meta device, sharded, until the program materializes them (``to_empty`` and its own
    initialization). ``sync_module_states`` broadcasts rank 0's values first; ``buffer_dtype``
    casts floating-point buffers.
    """
    ignored = prepared.ignored
    region = list(walk_region(module, ignored))
    params = owned_params(module, ignored, exclude)
    if prepared.meta and materialize_meta:  # nested units have materialized theirs; now this unit's own
        named = [(clean_name(n).rstrip("."), m) for n, m in breadth_first(region)]
        params = materialize(named, params, prepared.device, param_init_fn)
        _place(module, prepared.device, config.offload, ignored)
        _check_one_device(module, ignored)
    if sync_module_states:
        for g in groups.broadcast_order:
            _broadcast_module(region, g)
    if config.keep_param_objects:  # the FSDP1 wrapper registers plain tensors
        check_plain(params, "FullyShardedDataParallel")
    unit = unit_class(params)(type(module).__name__, params, groups.shard, groups.replicate, config)
    if config.comm_quantization is not None and unit.shard_size == 1:
        _warn_quantization_unused(unit.name)
    if buffer_dtype is not None:
        _cast_buffers(module, buffer_dtype, ignored)
    return unit


def unit_config(
    device: torch.device,
    reshard_after_forward: bool,
    mp: MixedPrecision | None,
    offload: bool,
    keep_param_objects: bool = False,
    comm_quantization: CommQuantization | None = None,
) -> UnitConfig:
    """A UnitConfig from the front ends' settings (offload only means something on a GPU)."""
    return UnitConfig(
        compute_device=device,
        reshard_after_forward=reshard_after_forward,
        param_dtype=mp.param_dtype if mp else None,
        reduce_dtype=mp.reduce_dtype if mp else None,
        keep_low_precision_grads=bool(mp and mp.keep_low_precision_grads),
        offload=offload and device.type != "cpu",
        keep_param_objects=keep_param_objects,
        comm_quantization=comm_quantization,
    )


def _as_device(device_id: int | str | torch.device) -> torch.device:
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    device = torch.device(device_id)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_warned_offload_on_cpu = False
_warned_quantization_unused = False


def reset_warnings() -> None:
    """Warn again about what is warned once per process (a test harness's fresh start)."""
    global _warned_offload_on_cpu, _warned_quantization_unused
    _warned_offload_on_cpu = _warned_quantization_unused = False


def _warn_quantization_unused(name: str) -> None:
    """Warn (once per process) that a unit sharded over one rank has nothing to quantize."""
    global _warned_quantization_unused
    if _warned_quantization_unused:
        return
    _warned_quantization_unused = True
    warnings.warn(
        f"comm_quantization has no effect on FSDP unit {name!r}: it is sharded over one rank (world size 1 "
        "or NO_SHARD), so it gathers nothing and its gradients are only all-reduced, exactly; pass "
        "comm_quantization=None to silence this",
        UserWarning,
        stacklevel=5,
    )


def _compute_device(module: nn.Module, device_id: Any, offload: bool, ignored: Modules) -> torch.device:
    """Where the unit computes: ``device_id``, else the module's device (a GPU under offload)."""
    global _warned_offload_on_cpu
    current = next(
        (
            t.device
            for _, m in walk_region(module, ignored)
            for t in own_tensors(m)
            if not is_sharded(t) and not t.is_meta
        ),
        None,
    )
    if device_id is not None:
        device = _as_device(device_id)
        if current is not None and current.type == "cuda" and device.type == "cuda" and current != device:
            raise ValueError(
                f"module is on {current} but device_id={device}: move the module to {device} or "
                f"pass device_id={current.index}"
            )
    elif current is not None and current.type != "cpu":
        device = current
    elif offload and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = current or torch.device("cpu")
    if offload and device.type == "cpu" and not _warned_offload_on_cpu:
        _warned_offload_on_cpu = True
        warnings.warn(
            "cpu_offload has no effect on a CPU-only run: the shards already live in CPU memory",
            UserWarning,
            stacklevel=4,
        )
    return device


def _place(module: nn.Module, device: torch.device, offload: bool, ignored: Modules) -> None:
    """Move the unit's region to ``device``; under offload only its buffers (shards stay on CPU).

    Nested units are left alone: they were placed when they were built, and ``Module.to`` on
    them would replace their registered shards (DTensor parameters are swapped, not assigned),
    cutting them off from their unit. Parameters move in place (``p.data``), so the Parameter
    objects an optimizer may already hold stay the module's.
    """
    if device.type == "cpu":
        return
    for m in ignored:  # modules FSDP leaves alone compute on the device as they are
        m.to(device)
    with torch.no_grad():
        for _, m in walk_region(module, ignored):
            if not offload:
                for p in compat.module_parameters(m).values():
                    if p is not None and not is_sharded(p) and p.device != device:
                        grad, p.grad = p.grad, None
                        p.data = p.data.to(device)
                        p.grad = None if grad is None else grad.to(device)
            buffers = compat.module_buffers(m)
            for name, b in buffers.items():
                if b is not None and b.device != device:
                    buffers[name] = b.to(device)


def _cast_buffers(module: nn.Module, dtype: torch.dtype, ignored: Modules) -> None:
    """Cast floating-point buffers to ``dtype``, remembering the original for state dicts."""
    for _, m in walk_region(module, ignored):
        for name, b in compat.module_buffers(m).items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                originals = m.__dict__.setdefault("_fullshard_buffer_dtypes", {})
                originals.setdefault(name, b.dtype)
                compat.module_buffers(m)[name] = b.to(dtype)


def ignored_modules(
    ignored_modules: Iterable[nn.Module] | None, ignored_states: Iterable[Any] | None
) -> frozenset[nn.Module]:
    """The modules a wrapper leaves alone: those given, with all their submodules. Parameters in
    ``ignored_states`` are marked instead (as ``fully_shard``'s ``ignored_params``): no unit
    shards, gathers or reduces them, and they stay where they are.

    Raises:
        ValueError: both arguments given; an FSDP unit among them.
        TypeError: an entry that is neither an nn.Module nor (in ``ignored_states``) a parameter.
    """
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("pass ignored_modules or ignored_states, not both")
    chosen = list(ignored_modules or []) + list(ignored_states or [])
    out: set[nn.Module] = set()
    for m in chosen:
        if isinstance(m, nn.Parameter) and ignored_states is not None:
            if is_sharded(m):
                raise ValueError("ignored_states must not contain parameters an FSDP unit already sharded")
            m._fullshard_ignored = True  # type: ignore[attr-defined]
            continue
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"ignored_modules must hold nn.Module objects (ignored_states: modules or parameters), got "
                f"{type(m).__name__}; pass the submodules or parameters to ignore"
            )
        if is_unit(m):
            raise ValueError("ignored_modules must not contain FSDP units (wrapped or fully_shard modules)")
        out.update(m.modules())
    return frozenset(out)


def walk_region(module: nn.Module, ignored: Modules, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) for ``module``'s tree, stopping at nested FSDP and ignored modules."""
    yield prefix, module
    for name, child in module.named_children():
        if is_unit(child) or child in ignored:
            continue
        yield from walk_region(child, ignored, f"{prefix}{name}.")


def mark_managed(
    module: nn.Module, ignored: Modules = frozenset(), ignored_params: AbstractSet[nn.Parameter] | None = None
) -> None:
    """Mark the modules of ``module``'s region (:func:`walk_region`: up to nested units and
    ``ignored`` modules) as torch's FSDP marks the modules it manages, both front ends:
    ``_is_fsdp_managed_module`` and ``_fsdp_use_orig_params`` set True. With ``ignored_params``
    (``fully_shard``'s, even empty) a module is left unmarked, as torch leaves it, when it has
    no buffer of its own, ignores all its own parameters and leaves all its children unmarked.

    Code outside torch reads the first: transformers' ``is_fsdp_managed_module`` turns on
    ``synced_gpus`` in ``generate``, so that a rank whose sequences are finished keeps running
    forwards (and their all-gathers) until every rank's are; without the mark a rank that
    finished first leaves the others waiting in an all-gather. Dynamo reads both, and traces
    such modules unspecialized (their parameters as inputs), as under torch's FSDP.
    """
    unmarked: dict[nn.Module, bool] = {}

    def all_ignored(m: nn.Module) -> bool:
        if m not in unmarked:
            own = compat.module_parameters(m).values()
            unmarked[m] = (
                ignored_params is not None
                and not any(b is not None for b in compat.module_buffers(m).values())
                and all(p is None or p in ignored_params for p in own)
                and all(all_ignored(c) for c in m.children())
            )
        return unmarked[m]

    for _, m in walk_region(module, ignored):
        if not all_ignored(m):
            m._is_fsdp_managed_module = True  # type: ignore[assignment]
            m._fsdp_use_orig_params = True  # type: ignore[assignment]


def _check_one_device(module: nn.Module, ignored: Modules) -> None:
    devices: dict[torch.device, str] = {}
    for prefix, m in walk_region(module, ignored):
        for name, p in compat.module_parameters(m).items():
            if p is not None and not is_sharded(p):
                devices.setdefault(p.device, prefix + name)
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ValueError(
            f"module has parameters on more than one device ({listing}); move it to one device "
            "first (module.to(device)) or pass device_id="
        )


def param_holders(module: nn.Module) -> dict[int, set[int]]:
    """id(parameter) -> ids of every module that registers it (tied parameters have several)."""
    holders: dict[int, set[int]] = {}
    for m in module.modules():
        for p in compat.module_parameters(m).values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(m))
    return holders


def shared_outside(child: nn.Module, holders: dict[int, set[int]]) -> set[int]:
    """Parameters of ``child``'s tree also registered outside it: a common ancestor owns them."""
    inside = {id(m) for m in child.modules()}
    return {id(p) for p in child.parameters() if not holders.get(id(p), set()) <= inside}


def owned_params(
    module: nn.Module, ignored: Modules, exclude: AbstractSet[int]
) -> list[tuple[str, nn.Parameter, list[ParamSlot]]]:
    """The parameters this unit owns: all in ``module``'s tree that no nested unit sharded.

    That includes tied parameters nested units left to this one (with all their slots, nested
    ones too), and leaves out ``exclude`` (parameters shared beyond ``module``).

    Raises:
        ValueError: a parameter sharded by a nested unit is also used outside that unit.
    """
    # An explicit stack, not a recursive closure: a closure cycle would keep the original full
    # parameters alive until the garbage collector runs, long after sharding.
    owned: dict[int, tuple[str, nn.Parameter, list[ParamSlot]]] = {}
    stack: list[tuple[nn.Module, str, bool]] = [(module, "", False)]
    while stack:
        m, prefix, nested = stack.pop()
        for name, p in compat.module_parameters(m).items():
            if p is None or id(p) in exclude or hasattr(p, "_fullshard_ignored"):
                continue
            if is_sharded(p) and nested:
                continue  # the nested unit's own parameter
            tied_to = p._fullshard_param.fqn if is_sharded(p) else getattr(p, "_fullshard_sharded_as", None)  # type: ignore[attr-defined]
            if tied_to is not None:
                raise ValueError(
                    f"parameter {clean_name(prefix + name)} is tied to {tied_to}, which a nested FSDP unit "
                    "already sharded; wrap the modules that share it inside one unit (let one "
                    "auto_wrap_policy wrap the whole model, which keeps tied parameters in their "
                    "common ancestor)"
                )
            entry = owned.setdefault(id(p), (clean_name(prefix + name), p, []))
            entry[2].append(ParamSlot(m, name))
        children = [(c, f"{prefix}{n}.", nested or is_unit(c)) for n, c in m.named_children()]
        stack.extend(reversed([c for c in children if c[0] not in ignored]))  # keep module order
    return list(owned.values())


def _broadcast_module(region: list[tuple[str, nn.Module]], group: collectives.ProcessGroup) -> None:
    """Give every rank rank 0's parameters and buffers of one unit's modules (collective).

    Raises:
        ValueError: on every rank, before any broadcast, when the ranks' modules hold tensors of
            other shapes or dtypes (rank-dependent model code): naming the first module that differs.
    """
    device = collectives.reduction_device(group)
    _check_same_tensors(region, group)
    with torch.no_grad():
        for _, m in region:
            for t in own_tensors(m):
                if not is_sharded(t):
                    flat = t.detach().reshape(-1).to(device).contiguous()  # NCCL needs CUDA tensors
                    collectives.broadcast(flat, 0, group)
                    t.detach().copy_(flat.view_as(t))


def _check_same_tensors(region: list[tuple[str, nn.Module]], group: collectives.ProcessGroup) -> None:
    """Refuse ``sync_module_states`` over ranks whose modules differ: mismatched broadcasts abort
    gloo in C++ or, where the sizes agree, copy the wrong tensors (one object gather per unit, at
    construction only)."""

    def shapes(m: nn.Module) -> list[str]:
        return [f"{tuple(t.shape)} {t.dtype}" for t in own_tensors(m) if not is_sharded(t)]

    mine = [(clean_name(name) or "<root>", shapes(m)) for name, m in region]
    every = collectives.all_gather_object(mine, group)
    if all(theirs == every[0] for theirs in every):
        return
    k = first_difference(every)
    seen = per_rank(every, k, lambda m: f"{m[0]!r} holds [{', '.join(m[1])}]", "no such module")
    raise ValueError(
        f"sync_module_states=True: the ranks' modules differ at module #{k} of this unit ({seen}): every rank must "
        "build the same model before wrapping (rank-dependent model code?); sync_module_states copies rank 0's "
        "values into it, it cannot change its shapes"
    )
