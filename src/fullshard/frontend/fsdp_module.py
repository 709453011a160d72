"""``FSDPModule``: the methods a module gains from ``fully_shard``, torch FSDP2's API on units.

``fully_shard`` makes a module's class ``FSDP<Cls>``, a subclass of :class:`FSDPModule` and of
its own class ``Cls``; these methods reach the module's unit through its FSDP state
(:func:`~fullshard.engine.hooks.fsdp_state`): gradient sync and resharding toggles, explicit
prefetching, and ``unshard`` / ``reshard`` by hand (:class:`UnshardHandle` for an async one).

fullshard's :class:`FSDPModule` is a subclass of torch's ``torch.distributed.fsdp.FSDPModule``,
so frameworks that look for torch's class (``isinstance(m, FSDPModule)``: Accelerate, the HF
Trainer, Lightning, torchtitan) find fullshard's units. The MRO is
``FSDP<Cls>, fullshard FSDPModule, torch FSDPModule, Cls``: every method of torch's class is
defined here again, so none of torch's code (which reads torch's own per-module state) runs on
a fullshard unit; one torch adds later raises NotImplementedError naming it.
"""

from __future__ import annotations

import copyreg
import sys
import warnings
from typing import Any, Callable, NoReturn, Optional

from torch import nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from fullshard import compat
from fullshard.engine import custom_comm, dynamo_guard, hooks, recovery, shard_sync
from fullshard.engine.all_gather_extension import ExtensionUnit
from fullshard.engine.inference_guard import outside_inference_mode
from fullshard.engine.unit import ShardState, Unit
from fullshard.frontend import pipelining


class UnshardHandle(_TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        """Finish the all-gather and register the full parameters; a no-op once the forward it
        was started for has waited for it and resharded the unit since (as torch's)."""
        if not self._unit.has_pending_gather and self._unit.shard_state is ShardState.SHARDED:
            return
        self._unit.wait_for_unshard()
        _register_unsharded(self._unit)


def _state(module: nn.Module) -> hooks.FSDPState:
    state = hooks.fsdp_state(module)
    assert state is not None, "an FSDPModule always heads a unit"
    return state


def _ignored(method: str, why: str) -> None:
    warnings.warn(f"FSDPModule.{method} is ignored by fullshard: {why}", UserWarning, stacklevel=3)


def _unsupported(method: str, why: str = "") -> NoReturn:
    raise NotImplementedError(
        f"FSDPModule.{method} (torch's FSDP2 API) is not supported by fullshard's fully_shard{why}; "
        "use torch.distributed.fsdp.fully_shard for a model that needs it"
    )


def _new_unit_object(cls: type, *args: Any) -> Any:
    """``copy`` / ``pickle``'s constructor for an ``FSDP<Cls>`` object: an empty one of that class."""
    return object.__new__(cls)


class FSDPModule(_TorchFSDPModule):
    """Methods a module gains from ``fully_shard`` (it stays an instance of its own class too).

    A subclass of torch's ``FSDPModule`` (see the module's note); ``isinstance(m,
    torch.distributed.fsdp.FSDPModule)`` is True for fullshard's units, and fullshard tells its
    own units from torch's by their FSDP state.
    """

    # In FSDP<Cls>'s MRO (FSDP<Cls>, this class, torch's FSDPModule, Cls, ...), Cls is at 3.
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """``FSDP<Cls>(...)`` builds a plain ``Cls`` (as torch's does): a container indexed by a
        slice (``nn.Sequential``, ``nn.ModuleList``) makes a new, unsharded container of its class."""
        orig = cls.__mro__[cls._orig_cls_mro_index]
        self = orig.__new__(orig, *args, **kwargs)
        # torch's switch for code that rebuilds modules without running __init__ (dynamo's packages)
        # (read where torch's __new__ reads it; torch versions without the switch always initialize)
        if compat.fsdp_module_new_inits():
            self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> NoReturn:
        # A copy would share the unit's process groups and flat buffers (neither can be copied).
        raise RuntimeError(
            f"copy.deepcopy of {type(self).__name__}, a module sharded by fully_shard, is not supported (nor is "
            "it by torch's): deep-copy the model before sharding it, or build a new one and load a state dict"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.copy / pickle rebuild an FSDP<Cls> object with cls.__new__(cls), which
        # would be the constructor call above: rebuild it empty instead, then restore its state.
        reduced = super().__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and reduced and reduced[0] is getattr(copyreg, "__newobj__"):
            return (_new_unit_object, *reduced[1:])
        return reduced

    @outside_inference_mode
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.state_dict``, also under ``torch.inference_mode()`` (a checkpoint saved
        inside an evaluation loop): a view of a DTensor made before inference mode fails in it
        ("Cannot set version_counter for inference tensor", torch's as well), so the state dict
        of this module and of its descendants is taken with inference mode off."""
        return super().state_dict(*args, **kwargs)  # type: ignore[misc]

    def _get_fsdp_state(self) -> NoReturn:
        # Only torch's methods read torch's state; each is defined here again. One that torch
        # adds after this was written would reach this: name it.
        caller = sys._getframe(1).f_code.co_name
        _unsupported(caller, " (a torch method fullshard does not define)")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Module.to() / .float(): torch's FSDPModule._apply works on torch's state; skip it.
        return compat.module_apply_after(_TorchFSDPModule, self, *args, **kwargs)

    def _units(self, recurse: bool) -> list[Unit]:
        assert isinstance(self, nn.Module)
        modules = self.modules() if recurse else [self]
        units = {id(_state(m).unit): _state(m).unit for m in modules if hooks.is_unit(m)}
        return list(units.values())

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients locally and reduces nothing.

        For hybrid sharding it sets the replica all-reduce too, as torch's does: True after
        ``set_requires_all_reduce(False)`` turns both collectives back on."""
        for unit in self._units(recurse):
            unit.sync_grads = requires_gradient_sync
            unit.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: with False, gradients are reduce-scattered within the shard group and
        summed locally; the all-reduce across replicas happens (on the sum) at the next backward
        with True that reaches the unit. A unit that backward does not reach (a branch the last
        micro-batch skipped) keeps its sum, its shards' ``.grad`` unchanged, across optimizer
        steps and ``zero_grad``, until a later backward all-reduces it: torch's FSDP2 does the
        same. No effect without a replicate dimension."""
        for unit in self._units(recurse):
            unit.all_reduce_grads = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, the full parameters stay gathered after backward (for gradient
        accumulation without a new all-gather), and the next forward reuses them: while the flag
        stays False they are the values from before any optimizer step in between, as in torch.
        Set True again before the last backward of an accumulation. Unlike torch, a unit still
        gathered at the next root forward whose flag is True by then is resharded and gathered
        afresh (torch reuses the kept, older values). While gathered, the module's attributes
        are plain full tensors (torch's are full ``nn.Parameter``); ``parameters()`` gives the
        sharded DTensors."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the full parameters after forward (True) or keep them for backward.

        As torch's, this is honoured by the root too (whose ``fully_shard`` default otherwise
        keeps them), and it replaces a ``reshard_after_forward=M``: with True such a unit frees
        everything after forward (its backward all-gathers over the whole shard group again).

        Raises:
            ValueError: ``reshard_after_forward`` is not a bool (torch's message)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward
            unit.auto_reshard_after_forward = False
            unit.drop_post_forward_group()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API: fullshard always waits for every reduction at the end of
        backward (torch's True), so results never depend on this flag; False, with which torch
        may skip that wait, warns (UserWarning) that it changes nothing, except from torch's
        pipeline stage (every micro-batch, then True at its gradient reduction), which is checked
        instead (:func:`~fullshard.frontend.pipelining.called_by_stage`).

        Raises:
            NotImplementedError, RuntimeError: from a pipeline stage, as ``called_by_stage`` says.
        """
        if not pipelining.called_by_stage(sys._getframe(1), is_last_backward) and not is_last_backward:
            warnings.warn(
                "FSDPModule.set_is_last_backward(False) is not used: fullshard waits for every gradient "
                "reduction at the end of each backward (as torch does with True); results are the same",
                UserWarning,
                stacklevel=2,
            )

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the data-parallel
        world size (this module's own unit only, as torch's; call it on each module to change).

        Raises:
            ValueError: ``factor`` is not positive.
        """
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor}")
        for unit in self._units(recurse=False):
            unit.divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[_TorchFSDPModule]) -> None:
        """When this module's forward starts, start the all-gathers of ``modules`` (in order)
        instead of the default (none, or the next unit with ``forward_prefetch``)."""
        _state(self).prefetch_in_forward = [_unit_of(m, "set_modules_to_forward_prefetch") for m in modules]  # type: ignore[arg-type]

    def set_modules_to_backward_prefetch(self, modules: list[_TorchFSDPModule]) -> None:
        """When this module's backward starts, start the all-gathers of ``modules`` (in order)
        instead of the default (the unit that ran before it in forward)."""
        _state(self).prefetch_in_backward = [_unit_of(m, "set_modules_to_backward_prefetch") for m in modules]  # type: ignore[arg-type]

    def set_post_optim_event(self, event: Any) -> None:
        """An event (``torch.cuda.Event`` or ``torch.Event``, recorded after the optimizer step)
        that the next forward's all-gathers wait for, instead of the whole current stream; on the
        CPU there is nothing to wait for. Call on the root module."""
        state = hooks.lazy_init(self)  # type: ignore[arg-type]
        assert state.root is not None
        state.root.post_optim_event = event

    @dynamo_guard.outside_dynamo  # called from compiled code (a chunked loss), it runs eagerly
    @outside_inference_mode
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now; while gathered, ``parameters(recurse=False)``
        yields the full parameters (in ``param_dtype``), as torch's does. The next forward then
        needs no all-gather; ``reshard()`` or the end of forward/backward frees them.

        Raises:
            NotImplementedError, RuntimeError: called by a torch pipeline schedule that cannot run
                on fullshard's units, as :func:`~fullshard.frontend.pipelining.check_schedule` says.
        """
        pipelining.check_schedule(sys._getframe(1))
        state = hooks.lazy_init(self)  # type: ignore[arg-type]
        unit = self._units(recurse=False)[0]
        unit.unshard(async_op=async_op)
        assert state.root is not None
        state.root.gathered_by_hand[id(unit)] = shard_sync.shards_version(unit)  # the next forward keeps it
        if async_op:
            return UnshardHandle(unit)
        _register_unsharded(unit)
        return None

    @dynamo_guard.outside_dynamo
    @outside_inference_mode
    def reshard(self) -> None:
        """Free this module's full parameters; the shards are registered again."""
        self._units(recurse=False)[0].reshard()

    # torch's other FSDPModule methods. Settings that change only speed or memory on torch's
    # side are accepted with a warning; ones that change results raise NotImplementedError.

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's deprecated name for :meth:`set_gradient_divide_factor`."""
        warnings.warn("Use set_gradient_divide_factor instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """fullshard's own reductions always sum (``ReduceOp.SUM``) and divide separately, what
        torch does with True. The flag (this module's unit only, as torch's) chooses the op a
        custom reduce-scatter (:meth:`set_custom_reduce_scatter`) gets: with True always
        ``SUM``, with False (the default) torch's ``AVG`` or ``PREMUL_SUM``. False on a unit
        without a custom reduce-scatter warns (UserWarning) that it changes nothing."""
        unit = _state(self).unit  # type: ignore[arg-type]
        unit.grads.force_sum = enable
        if not enable and unit.grads.custom_reduce_scatter is None:
            _ignored("set_force_sum_reduction_for_comms(False)", "its reductions always sum and divide separately")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted: with False fullshard still gathers this unit for backward (torch skips the
        all-gather for units whose parameters backward does not need); the results are the same,
        and a UserWarning says so."""
        if not unshard_in_backward:
            _ignored("set_unshard_in_backward(False)", "it gathers every unit for backward (same results)")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """With True, every trainable parameter gets a ``.grad`` after a synced backward, as
        torch's does: one no backward reached gets the reduced gradient (zeros where no rank
        used it), and a unit that backward did not reach at all reduces zeros at its end. With
        False (the default) such a parameter keeps ``.grad`` None. Within a unit that backward
        reaches, fullshard reduce-scatters every parameter either way, so ranks that used a
        parameter and ranks that did not (torch needs True for them) sum correctly with both.

        With True on some unit of a tree, every rank launches its units' reductions in one
        rank-independent order (reverse construction order, the root last;
        :mod:`fullshard.engine.reduce_order`) and reduces each flagged unit in every synced
        backward (zeros where backward did not reach it), so units that backward reaches on some ranks
        only (rank-dependent control flow: MoE experts) sum with themselves, not each other. A
        unit reached before its turn keeps its gradient until the units before it have reduced:
        a model whose backward reaches its units in reverse construction order loses no overlap.
        Backward's all-gathers are not reordered: a unit reached on some ranks only must need
        none (``reshard_after_forward=False``, and no backward prefetch of it)."""
        for unit in self._units(recurse):
            unit.grads.unused_grads_none = not reduce_scatter_unused_params
            unit.grads.reduce_unreached = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted with a UserWarning: fullshard keeps its own reduce-scatter buffers."""
        _ignored("set_reduce_scatter_max_input_buffers", "it keeps its own reduce-scatter buffers")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted with a UserWarning: fullshard reduces on the unit's own group."""
        if enable:
            _ignored("set_separate_reduce_scatter_group", "it reduce-scatters on the unit's own group")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted with a UserWarning: fullshard allocates its own communication buffers.

        Raises:
            ValueError: a custom all-gather or reduce-scatter is set (torch refuses too).
        """
        self._no_custom_comm("set_allocate_memory_from_process_group_for_comm")
        if enable:
            _ignored("set_allocate_memory_from_process_group_for_comm", "it allocates its own buffers")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted with a UserWarning: fullshard does not use symmetric memory.

        Raises:
            ValueError: a custom all-gather or reduce-scatter is set (torch refuses too).
        """
        self._no_custom_comm("set_symm_mem_for_comm")
        _ignored("set_symm_mem_for_comm", "it does not use symmetric memory")

    def _no_custom_comm(self, method: str) -> None:
        unit = _state(self).unit  # type: ignore[arg-type]
        for setter, comm in (
            ("set_custom_all_gather", unit.custom_all_gather),
            ("set_custom_reduce_scatter", unit.grads.custom_reduce_scatter),
        ):
            if comm is not None:
                raise ValueError(
                    f"FSDPModule.{method} cannot be used on a module with a custom comm ({setter}: "
                    f"{type(comm).__name__}), which allocates its own buffers (torch refuses it too); "
                    f"call {setter}(None) first, or leave {method} out"
                )

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward, make the tree ready for the next
        iteration (torch's FSDP2 API): wait for the collectives in flight, reshard every unit,
        and discard the aborted iteration's gradients that had not reached the shards' ``.grad``
        (reductions in flight, sums accumulated with gradient sync or the replica all-reduce
        off): a gradient-accumulation sequence starts again. Call it on the root on every rank
        (each waits for its peers' parts of the collectives in flight), then ``zero_grad`` if
        the aborted backward may have set some ``.grad``.

        Raises:
            RuntimeError: called on a unit that is not the root of its tree.
        """
        state = _state(self)  # type: ignore[arg-type]
        if state.root is None:
            return  # no forward yet: nothing to reset
        if not state.is_root:
            raise RuntimeError(
                f"reset_iter_state must be called on the root FSDP module (the module whose forward runs "
                f"first, fully_shard's last call), not on {type(self).__name__} (unit {state.unit.name!r})"
            )
        recovery.reset_iteration(state.root)

    def set_custom_all_gather(self, comm: Any) -> None:
        """All-gather this module's unit's parameters through ``comm`` (torch's ``AllGather``
        protocol) instead of fullshard's own collectives: forward, backward, ``unshard()`` and
        prefetches alike. As torch's, for this module's unit only, not its submodules' units.

        On each unshard fullshard calls ``comm.allocate((N*S,), dtype=..., device=...)`` for the
        output (S: the unit's padded shard elements, parameters back to back, frozen ones
        included; the compute dtype, ``param_dtype`` under mixed precision; the compute device),
        copies this rank's shards into its slice ``[r*S, (r+1)*S)``, and calls
        ``comm(output_tensor=output, input_tensor=that slice, group=<the unit's shard group>,
        async_op=...)``; the comm returns None (done) or a Work that fullshard waits on before
        the gathered values are copied out. ``async_op`` is True for fullshard's prefetches and
        ``unshard(async_op=True)``, False otherwise (torch passes False for its prefetches too,
        relying on CUDA streams). Under ``reshard_after_forward=M``, backward's all-gather
        within the M-rank group goes through ``comm`` too, with that group. The collectives
        layer counts the call (probes, flight recorder) as an all-gather of the payload it was
        given; what the comm really sends is its own business. Details:
        :mod:`fullshard.engine.custom_comm`.

        Args:
            comm: an object with ``allocate(size, *, dtype, device)`` and ``__call__`` as above;
                None goes back to fullshard's own all-gather (torch has no way back).

        Raises:
            TypeError: ``comm`` lacks ``allocate`` or is not callable.
            ValueError: the unit all-gathers quantized (``comm_quantization`` with ``params``).
            NotImplementedError: the unit holds all-gather extension parameters
                (``fsdp_pre_all_gather``, float8), which fullshard gathers separately.
        """
        unit = self._custom_comm_unit(comm, "set_custom_all_gather")
        unit.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's unit's gradients through ``comm`` (torch's
        ``ReduceScatter`` protocol) instead of fullshard's own collectives. As torch's, for this
        module's unit only, not its submodules' units.

        At each synced backward fullshard calls ``comm.allocate((N*S_t,), ...)`` for the input
        and ``comm.allocate((S_t,), ...)`` for the output (S_t: the trainable parameters' padded
        shard elements; the reduce dtype; the compute device), copies the packed gradient into
        the input (rank r's chunk: the rows rank r owns of each parameter), and calls
        ``comm(output_tensor=output, input_tensor=input, group=<the unit's shard group>,
        op=<ReduceOp>)`` without ``async_op``, as torch does; a Work it returns is waited on at
        the end of backward. The op is torch's: ``AVG`` in float32 and bfloat16, ``PREMUL_SUM(1/f)``
        after ``set_gradient_divide_factor(f)`` (``SUM`` then a division by f on gloo, which has
        no PREMUL_SUM: torch's own fails there), ``SUM`` with fullshard dividing before and after
        in float16 or after ``set_force_sum_reduction_for_comms(True)``. The comm must apply the
        op (averaging included). The shards' ``.grad`` become views of the output (copies when
        cast or offloaded); a hybrid unit's replica all-reduce stays fullshard's. Unlike torch,
        every trainable parameter is in the input (zeros for one no gradient reached; torch
        leaves such parameters out). Counted by the collectives layer as a reduce-scatter of the
        payload it was given. Details: :mod:`fullshard.engine.custom_comm`.

        Args:
            comm: an object with ``allocate(size, *, dtype, device)`` and ``__call__`` as above;
                None goes back to fullshard's own reduce-scatter (torch has no way back).

        Raises:
            TypeError: ``comm`` lacks ``allocate`` or is not callable.
            ValueError: the unit reduces quantized (``comm_quantization`` with ``grads``).
            NotImplementedError: the unit holds all-gather extension parameters
                (``fsdp_pre_all_gather``, float8), whose gradients fullshard reduces separately.
        """
        unit = self._custom_comm_unit(comm, "set_custom_reduce_scatter")
        unit.grads.custom_reduce_scatter = comm

    def _custom_comm_unit(self, comm: Any, setter: str) -> Unit:
        """This module's unit, once ``comm`` is known to suit it (see the setters)."""
        unit = _state(self).unit  # type: ignore[arg-type]
        if comm is not None and isinstance(unit, ExtensionUnit):
            raise NotImplementedError(
                f"FSDPModule.{setter}: FSDP unit {unit.name!r} holds all-gather extension parameters "
                "(fsdp_pre_all_gather, e.g. torchao float8), which fullshard communicates apart from the unit's "
                "buffer, so a custom comm would not see them; shard those parameters' modules as units without a "
                "custom comm, or use torch.distributed.fsdp.fully_shard for this model"
            )
        custom_comm.check(unit, comm, setter)
        return unit

    def set_all_reduce_hook(self, hook: Callable[[Any], None], *, stream: Any = None) -> None:
        """Run ``hook(reduced)`` on this module's unit's reduced gradient shard (shape (S_t,),
        the reduce dtype) after each reduction: after the reduce-scatter, or under HSDP after
        the replica all-reduce, before it becomes the shards' ``.grad`` (e.g. an all-reduce over
        a dimension the mesh does not hold). Not on a reduction kept as a partial sum
        (``set_requires_all_reduce(False)``). As torch's, for this module only (not recursive).
        fullshard's reduced shard is already divided by the data-parallel size (torch's may
        still hold a factor of it on some backends): a hook that sums or averages over other
        ranks gives the same result either way.

        Args:
            hook: called with the reduced shard, which it may change in place.
            stream: a CUDA stream for the hook (torch's option): fullshard runs the hook where
                the reduction finishes and ignores it, with a warning.

        Raises:
            ValueError: ``stream`` set on a hybrid-sharded unit (as torch's).
        """
        unit = _state(self).unit  # type: ignore[arg-type]
        if stream is not None:
            if unit.replicate_size > 1:
                raise ValueError("set_all_reduce_hook: stream cannot be set when using HSDP (as in torch)")
            _ignored("set_all_reduce_hook(stream=...)", "it runs the hook where the reduction finishes")
        unit.grads.all_reduce_hook = hook

    def _set_unshard_async_op(self, async_op: bool) -> None:
        if async_op:
            _ignored("_set_unshard_async_op(True)", "it chooses how to wait for its all-gathers")


def _unit_of(module: Any, caller: str) -> Unit:
    if not isinstance(module, nn.Module) or not hooks.is_unit(module):
        raise TypeError(f"{caller}: every module must be one given to fully_shard, got {type(module).__name__}")
    return _state(module).unit


def _register_unsharded(unit: Unit) -> None:
    """Register the full parameters (views of the gathered buffer) in the shards' places until
    the unit reshards, as torch's FSDP2 shows unsharded parameters after ``unshard()``."""
    if unit.shard_state is not ShardState.UNSHARDED:
        return
    for sp, full in zip(unit.params, unit.full_params()):
        sp.swap_registered(nn.Parameter(sp.unsharded(full.detach()), requires_grad=sp.requires_grad))
    unit.on_reshard = _restore_shards


def _restore_shards(unit: Unit) -> None:
    for sp in unit.params:
        if sp.swapped:
            assert sp.shard is not None
            sp.register_shard(sp.shard)
    unit.on_reshard = None
