"""``FSDPModule``: the methods a module gains from ``fully_shard``, torch FSDP2's API on units.

``fully_shard`` makes a module's class a subclass of both :class:`FSDPModule` and its own class;
these methods reach the module's unit through its hook state
(:func:`~fullshard.engine.hooks.fsdp_state`): gradient sync and resharding toggles, explicit
prefetching, and ``unshard`` / ``reshard`` by hand (:class:`UnshardHandle` for an async one).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from torch import nn

from fullshard.engine import hooks
from fullshard.engine.unit import ShardState, Unit


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_unshard()
        _register_unsharded(self._unit)


def _state(module: nn.Module) -> hooks.UnitHooks:
    state = hooks.fsdp_state(module)
    assert state is not None, "an FSDPModule always heads a unit"
    return state


class FSDPModule:
    """Methods a module gains from ``fully_shard`` (it stays an instance of its own class too)."""

    def _units(self, recurse: bool) -> list[Unit]:
        assert isinstance(self, nn.Module)
        modules = self.modules() if recurse else [self]
        units = {id(_state(m).unit): _state(m).unit for m in modules if hooks.is_unit(m)}
        return list(units.values())

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients locally and reduces nothing."""
        for unit in self._units(recurse):
            unit.sync_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: with False, gradients are reduce-scattered within the shard group and
        summed locally; the all-reduce across replicas happens (on the sum) at the next backward
        with True. No effect without a replicate dimension."""
        for unit in self._units(recurse):
            unit.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether to free the full parameters after forward (True) or keep them for backward."""
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, the full parameters stay gathered after backward (for gradient
        accumulation without a new all-gather); set True again before the optimizer step's
        last backward, or the next forward would use parameters from before the step."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API: fullshard always waits for every reduction at the end of
        backward (torch's True), so results never depend on this flag; False, with which torch
        may skip that wait, warns (UserWarning) that it changes nothing."""
        if not is_last_backward:
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

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's forward starts, start the all-gathers of ``modules`` (in order)
        instead of the default (none, or the next unit with ``forward_prefetch``)."""
        _state(self).prefetch_in_forward = [_unit_of(m, "set_modules_to_forward_prefetch") for m in modules]  # type: ignore[arg-type]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's backward starts, start the all-gathers of ``modules`` (in order)
        instead of the default (the unit that ran before it in forward)."""
        _state(self).prefetch_in_backward = [_unit_of(m, "set_modules_to_backward_prefetch") for m in modules]  # type: ignore[arg-type]

    def set_post_optim_event(self, event: Any) -> None:
        """A CUDA event (recorded after the optimizer step) that the next forward's all-gathers
        wait for, instead of the whole current stream. Call on the root module."""
        state = hooks.lazy_init(self)  # type: ignore[arg-type]
        assert state.root is not None
        state.root.post_optim_event = event

    @hooks.outside_dynamo  # called from compiled code (a chunked loss), it runs eagerly
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now; while gathered, ``parameters(recurse=False)``
        yields the full parameters (in ``param_dtype``), as torch's does. The next forward then
        needs no all-gather; ``reshard()`` or the end of forward/backward frees them."""
        hooks.lazy_init(self)  # type: ignore[arg-type]
        unit = self._units(recurse=False)[0]
        unit.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(unit)
        _register_unsharded(unit)
        return None

    @hooks.outside_dynamo
    def reshard(self) -> None:
        """Free this module's full parameters; the shards are registered again."""
        self._units(recurse=False)[0].reshard()


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
        sp.swap_registered(nn.Parameter(full.detach(), requires_grad=sp.requires_grad))
    unit.on_reshard = _restore_shards


def _restore_shards(unit: Unit) -> None:
    for sp in unit.params:
        if sp.swapped:
            assert sp.shard is not None
            sp.register_shard(sp.shard)
    unit.on_reshard = None
