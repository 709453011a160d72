"""``FullyShardedDataParallel``: torch FSDP1's wrapper API on fullshard's engine.

Each instance wraps one module and owns one unit: the parameters of that module that no nested
``FullyShardedDataParallel`` owns. ``auto_wrap_policy`` creates the nested instances bottom-up.
The outermost instance to run forward becomes the root and coordinates the tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.engine import build, dynamo_guard, frozen_backward, hooks
from fullshard.engine.config import (
    BackwardPrefetch,
    CommQuantization,
    CPUOffload,
    FrontEnd,
    MixedPrecision,
    ShardingStrategy,
)
from fullshard.engine.inference_guard import outside_inference_mode
from fullshard.engine.module_wrapper import FSDP_WRAPPED as WRAPPED
from fullshard.engine.unit import TrainingState, Unit
from fullshard.engine.wrapper_config import WrapperConfig
from fullshard.frontend import dsd_bridge, full_precision, summon
from fullshard.frontend.clip_grad import clip_grad_norm_
from fullshard.frontend.flat_param_view import FlatParamView, HandleView
from fullshard.frontend.fsdp1_args import take_deprecated, with_overrides, wrapper_config
from fullshard.frontend.fsdp1_state_dict import StateDictMethods, register_load_hooks, wrappers
from fullshard.frontend.wrap import CustomPolicy, apply_policy

if TYPE_CHECKING:  # torch's option types, accepted as well as fullshard's
    from torch.distributed import fsdp as torch_fsdp


class _Nested(NamedTuple):
    """What a wrapper built by an enclosing wrapper's wrap policy is given instead of options."""

    config: WrapperConfig  # the enclosing wrapper's finished config (for_nested)
    exclude: AbstractSet[int]  # ids of parameters shared beyond the module: the enclosing wrapper owns them


class FullyShardedDataParallel(StateDictMethods):
    """Shard a module's parameters, gradients and optimizer state across a process group.

    Same constructor as ``torch.distributed.fsdp.FullyShardedDataParallel``. After wrapping,
    ``parameters()`` yields this rank's shards: parameter ``p`` of shape (d0, *rest) becomes
    a tensor of shape (rows, *rest), rows = this rank's share of ceil(d0 / N)-row chunks (may
    be 0), in p's dtype. Names are the original module's. Any ``torch.optim`` optimizer then
    keeps about 1/N of the optimizer state.

    The options ``ShardingStrategy``, ``CPUOffload``, ``BackwardPrefetch`` and ``MixedPrecision``
    may be torch's (``torch.distributed.fsdp``) as well as fullshard's: a program that switched
    only its imports keeps working. They are translated by member name and field values (see
    ``fullshard.api``).

    Args:
        module: the module to wrap; its parameters must all be on one device (CPU with gloo,
            CUDA with NCCL).
        process_group: the group to shard over (default: the world group).
        sharding_strategy: a ShardingStrategy or its name (default FULL_SHARD).
        cpu_offload: CPUOffload or bool.
        auto_wrap_policy: a policy from ``fullshard.wrap`` or torch's (or a set of module classes).
        backward_prefetch: BACKWARD_PRE (default), BACKWARD_POST or None.
        mixed_precision: a MixedPrecision, or a dtype (torch.bfloat16) for all three dtypes.
            With an ``auto_wrap_policy``, the submodules of its ``_module_classes_to_ignore``
            (BatchNorm by default) become units of their own in full precision, as torch's
            (warns naming their classes; see ``fullshard.MixedPrecision``).
        ignored_modules: modules whose parameters are neither sharded nor reduced.
        param_init_fn: called on every module of a unit that has meta tensors, breadth first,
            as torch's (warns when nothing is on meta, unless ``sync_module_states``).
        device_id: a device (or CUDA index) to move the module to before sharding.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: start the next unit's all-gather during the current forward.
        limit_all_gathers: True, or False, which warns: fullshard never has more than the
            current unit's and one prefetched all-gather in flight.
        use_orig_params: None or True; False warns: names and shapes are always the original
            ones, and the original Parameter objects stay registered (their ``.data`` becomes
            this rank's shard), so an optimizer built before wrapping trains the model.
        ignored_states: modules to ignore (like ``ignored_modules``) or parameters: left whole,
            where they are, and never reduced (each rank keeps its own gradient), as torch's.
        device_mesh: a 1-D DeviceMesh whose group to shard over.
        comm_quantization: keyword only, fullshard's own: a :class:`~fullshard.CommQuantization`
            to all-gather parameters as int8 blocks and/or reduce-scatter gradients in bf16 or
            int8 (None: exact communication, as torch's).

    Raises:
        RuntimeError: no process group is initialized and none is given.
        ValueError: the module is already wrapped (by fullshard, or by torch's
            FullyShardedDataParallel or fully_shard anywhere in its tree), contains a module
            given to fullshard's ``fully_shard``, has parameters on several devices, an unknown
            strategy name, or conflicting arguments.
        NotImplementedError: an argument whose feature fullshard does not have yet.
        TypeError: a ``device_mesh`` that is not a DeviceMesh.
        TypeError: an unknown keyword argument; an option of a type neither fullshard's nor torch's.
    """

    wrapped_key = WRAPPED

    def __deepcopy__(self, memo: dict) -> NoReturn:
        # A copy would share the unit's process group and buffers, neither of which copies.
        raise RuntimeError(
            f"copy.deepcopy of a module sharded by fullshard's FullyShardedDataParallel "
            f"(wrapping {type(self.module).__name__}) is not supported (nor is it by torch's FSDP): deep-copy the "
            "model before wrapping it (an EMA copy: wrap both), or build a new one and load a state dict"
        )

    def __init__(
        self,
        module: nn.Module,
        process_group: collectives.ProcessGroup | None = None,
        sharding_strategy: None | str | ShardingStrategy | torch_fsdp.ShardingStrategy = None,
        cpu_offload: None | bool | CPUOffload | torch_fsdp.CPUOffload = None,
        auto_wrap_policy: Any | None = None,
        backward_prefetch: BackwardPrefetch | torch_fsdp.BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: None | torch.dtype | MixedPrecision | torch_fsdp.MixedPrecision = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: None | int | torch.device = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool | None = None,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: Any | None = None,
        *,
        comm_quantization: CommQuantization | None = None,
        _nested: _Nested | None = None,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        register_load_hooks(self)  # loads its part when a root that is no wrapper loads
        if _nested is not None:  # built by an enclosing wrapper's policy: its config is already checked
            self._shard(module, _nested.config, _nested.exclude)
            return
        auto_wrap_policy = take_deprecated(deprecated, auto_wrap_policy)
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                "module is already a FullyShardedDataParallel; wrap each module once (to change "
                "its settings, build a fresh model and wrap that)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        build.check_not_sharded_elsewhere(module, FrontEnd.WRAPPER)
        config = wrapper_config(
            module,
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            ignored_modules=ignored_modules,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            ignored_states=ignored_states,
            device_mesh=device_mesh,
            comm_quantization=comm_quantization,
        )
        self._shard(module, config, frozenset())
        dsd_bridge.install()  # torch's DCP get_state_dict / set_state_dict serve this wrapper

    def _shard(self, module: nn.Module, config: WrapperConfig, exclude: AbstractSet[int]) -> None:
        """Wrap the policy's submodules, then make ``module``'s remaining parameters this wrapper's unit.

        ``exclude``: ids of parameters shared beyond ``module``, which an enclosing wrapper owns.
        """
        prepared = build.prepare(module, config.device_id, config.offload_params, config.ignored)
        if config.auto_wrap_policy is not None:
            nested = config.for_nested(prepared.device)
            kept = full_precision.prepare(module, config.mixed_precision)  # BatchNorm: units of their own, no MP
            full = dataclasses.replace(nested, mixed_precision=None)
            holders = build.param_holders(module)

            policy = config.auto_wrap_policy

            def wrap(m: nn.Module) -> FullyShardedDataParallel:
                own = full if isinstance(m, kept) else nested
                overrides = policy.overrides(m) if isinstance(policy, CustomPolicy) else {}
                if overrides:  # CustomPolicy: this unit's own arguments
                    own = with_overrides(own, overrides, f"a {type(m).__name__}")
                return FullyShardedDataParallel(m, _nested=_Nested(own, build.shared_outside(m, holders)))

            apply_policy(
                module,
                full_precision.with_classes(config.auto_wrap_policy, kept),
                wrap=wrap,
                is_wrapped=lambda m: isinstance(m, FullyShardedDataParallel),
                ignored=config.ignored,
            )
        self._config = config
        unit = build.build_wrapper_unit(module, prepared, config, exclude)
        build.mark_managed(module, config.ignored)  # as torch's FSDP1 marks the modules it wraps
        hooks.set_fsdp_state(
            self,
            hooks.FSDPState(
                unit,
                FrontEnd.WRAPPER,
                ignored=config.ignored,
                mixed_precision=config.mixed_precision,
                backward_prefetch=config.backward_prefetch,
                forward_prefetch=config.forward_prefetch,
            ),
        )
        self.add_module(WRAPPED, module)

    # ------------------------------------------------------------------ structure
    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The sharding strategy this wrapper (and every wrapper of its tree) was built with."""
        return self._config.sharding_strategy

    @property
    def process_group(self) -> collectives.ProcessGroup:
        """The process group this wrapper was given, as torch's: the group its unit shards over,
        the group its gradients are all-reduced over under NO_SHARD (and the whole group at world
        size 1, where nothing is sent); with a hybrid strategy, the shard group (the replicas'
        all-reduce runs over another)."""
        return self._config.groups.broadcast_order[0]

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """The mixed-precision dtypes in force (None: the parameters' own)."""
        return self._config.mixed_precision

    @property
    def cpu_offload(self) -> CPUOffload:
        """Whether shards and their gradients live in CPU memory."""
        return self._config.cpu_offload

    @property
    def comm_quantization(self) -> CommQuantization | None:
        """The quantized communication in force (None: exact)."""
        return self._config.comm_quantization

    @property
    def unit(self) -> Unit:
        """This instance's FSDP unit (the parameters it owns)."""
        return self._unit_state.unit

    @property
    def _has_params(self) -> bool:
        """Whether this instance's unit owns any parameter (torch's private attribute, which
        Accelerate reads)."""
        return bool(self.unit.params)

    @property
    def _flat_param(self) -> FlatParamView | None:
        """This rank's flat shard as torch's private ``FlatParameter`` is read (None without
        parameters): see :mod:`fullshard.frontend.flat_param_view`."""
        return FlatParamView(self.unit) if self.unit.params else None

    @property
    def _handle(self) -> HandleView | None:
        """torch's private ``FlatParamHandle`` as Accelerate touches it (None without parameters)."""
        return HandleView(self.unit) if self.unit.params else None

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FullyShardedDataParallel in ``module``'s tree (only the outermost if root_only)."""
        return [m for m in wrappers(module, root_only) if isinstance(m, FullyShardedDataParallel)]

    def _lazy_init(self) -> None:
        hooks.lazy_init(self)

    def check_is_root(self) -> bool:
        """Whether this instance is the root of its tree (the outermost one to run first).

        Before the first forward, the call makes this instance the root of the instances under
        it, as torch's does."""
        self._lazy_init()
        return self._is_root

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Reduce the gradients of every unit in this tree with ``hook`` instead of fullshard's
        collectives (torch FSDP1's communication hooks, e.g. ``torch.distributed.algorithms.
        _comm_hooks.default_hooks.bf16_compress_hook`` with ``DefaultState(process_group)``).

        After each unit's backward with gradient sync on, the hook runs synchronously:
        ``hook(state, grad)`` under NO_SHARD (or at world size 1), where ``grad`` (S,) is the
        unit's full flat gradient to reduce in place; else ``hook(state, grad, output)``, where
        ``grad`` (N*S,) holds the full gradients packed so that chunk r is rank r's (the layout
        ``reduce_scatter_tensor`` takes) and ``output`` (S,) receives this rank's reduced chunk.
        Both are in the reduce dtype, and the hook does any division (torch's ``DefaultState``
        divides by the world size). Register it once, before training, on the root.

        Raises:
            RuntimeError: not called on the root, or a hook is registered already.
            TypeError: ``hook`` is not callable.
            ValueError: a unit uses hybrid sharding (not supported, as in torch) or
                ``comm_quantization``.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if not self.check_is_root():
            raise RuntimeError(
                "register_comm_hook must be called on the root FullyShardedDataParallel (the outermost wrapper)"
            )
        units = [m.unit for m in self.fsdp_modules(self)]
        for unit in units:
            if unit.shard_size > 1 and unit.replicate_size > 1:
                raise ValueError(
                    f"register_comm_hook: unit {unit.name!r} uses hybrid sharding, which communication hooks do not "
                    "support (nor do torch's): use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD"
                )
            if unit.config.comm_quantization is not None:
                raise ValueError(
                    f"register_comm_hook: unit {unit.name!r} has comm_quantization, which the hook would bypass: "
                    "use one or the other"
                )
            if unit.grads.comm_hook is not None:
                raise RuntimeError("register_comm_hook: a communication hook is registered already (register it once)")
        for unit in units:
            unit.grads.comm_hook = (state, hook)

    @property
    def _is_root(self) -> bool:
        return self._unit_state.is_root

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # torch.compile traces only the wrapped module's forward: the unit's pre- and
        # post-forward run outside dynamo, as fully_shard's hooks do (a compiled model breaks
        # its graph at each). Traced, the call goes without the try: dynamo cannot resume after
        # a graph break inside a try block (a nested unit's hooks are one), so it would run this
        # forward, and every nested unit's (they share its code), uncompiled. A compiled forward
        # that raises leaves its unit gathered and in FORWARD until the root's next forward,
        # which tidies up what the last iteration left.
        args, kwargs = _pre_forward(self, args, kwargs)
        if torch.compiler.is_compiling():
            output = self.module(*args, **kwargs)
        else:
            try:
                output = self.module(*args, **kwargs)
            except BaseException:
                _forward_failed(self)
                raise
        return _post_forward(self, output)

    # ------------------------------------------------------------------ gradient accumulation
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded) without communication inside the context.

        The first backward after the context reduces the accumulated sum.

        Raises:
            RuntimeError: called on a unit that is not the root.
        """
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("no_sync() must be called on the root FullyShardedDataParallel")
        units = [m.unit for m in self.fsdp_modules(self)]
        previous = [u.sync_grads for u in units]
        for u in units:
            u.sync_grads = False
        try:
            yield
        finally:
            for u, before in zip(units, previous):
                u.sync_grads = before

    @dynamo_guard.outside_dynamo  # collectives, recorded: eager under torch.compile (see clip_grad_norm_)
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every unit in this tree by their total (unsharded) norm.

        Collective: every rank calls it. Returns the total norm before clipping, computed in
        float64 and returned, as torch's FSDP1 returns it, in the promoted dtype of this rank's
        gradients (float32; float16 / bfloat16 under ``keep_low_precision_grads=True``), float32
        on a rank without gradients (with a ``UserWarning``, as torch's).

        Raises:
            RuntimeError: called on a unit that is not the root.
        """
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError(
                "clip_grad_norm_ must be called on the root FullyShardedDataParallel (the outermost "
                "wrapper): the norm spans every unit's gradients"
            )
        params = list(self.parameters())
        total = clip_grad_norm_(params, max_norm, norm_type)
        dtypes = [p.grad.dtype for p in params if p.grad is not None]
        if not dtypes:  # as torch's FSDP1 warns (another dtype would take a collective)
            rank = collectives.group_rank(collectives.default_group())
            warnings.warn(
                f"FSDP.clip_grad_norm_() on rank {rank} with no gradients: the total norm is returned in {total.dtype}",
                stacklevel=2,
            )
            return total
        return total.to(functools.reduce(torch.promote_types, dtypes))

    summon_full_params = staticmethod(summon.summon_full_params)

    def training_states(self) -> list[TrainingState]:
        """The training state of every unit in this tree (all IDLE between steps)."""
        return [m.unit.training_state for m in self.fsdp_modules(self)]


@dynamo_guard.outside_dynamo
@outside_inference_mode
def _pre_forward(wrapper: FullyShardedDataParallel, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Become the root at the first forward, prepare the inputs, gather the unit."""
    wrapper._lazy_init()
    args, kwargs = hooks.prepare_inputs(wrapper._unit_state, (args, kwargs))
    hooks.pre_forward(wrapper._unit_state)
    return frozen_backward.hook_frozen_inputs(wrapper._unit_state, (args, kwargs))


@dynamo_guard.outside_dynamo
@outside_inference_mode
def _post_forward(wrapper: FullyShardedDataParallel, output: Any) -> Any:
    return hooks.post_forward(wrapper._unit_state, output)


@dynamo_guard.outside_dynamo
@outside_inference_mode
def _forward_failed(wrapper: FullyShardedDataParallel) -> None:
    """A failed forward leaves the unit usable: shards back, full parameters freed, IDLE. A
    recomputation in backward (activation checkpointing stops it early by raising) must keep
    the unit gathered for the rest of its backward."""
    unit = wrapper.unit
    if unit.training_state is TrainingState.FORWARD:
        unit.reshard()
        unit.training_state = TrainingState.IDLE


FSDP = FullyShardedDataParallel
