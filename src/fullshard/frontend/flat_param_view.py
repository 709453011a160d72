"""The few of torch FSDP1's private wrapper attributes that frameworks read: ``_has_params``,
``_flat_param`` and ``_handle``.

HF Accelerate's FSDP1 path (``Accelerator.prepare_model`` under mixed precision, what the HF
Trainer runs with ``fsdp=...`` and ``bf16=True``) walks ``FSDP.fsdp_modules(model)`` and, for a
wrapper that manages parameters, upcasts a low-precision ``_flat_param`` to float32
(``param.data = param.data.to(torch.float32)``, then ``_handle._orig_param_dtype = torch.float32``),
so the optimizer steps on float32 master shards as DeepSpeed's ZeRO-3 does. fullshard keeps one
shard per parameter, not a flat parameter: :class:`FlatParamView` stands for this rank's flat
shard (the unit's local flat buffer), and setting its ``data`` to another dtype recasts the unit's
shards (:meth:`~fullshard.engine.layout.UnitLayout.recast_shards`).
"""

from __future__ import annotations

import torch

from fullshard.engine.unit import ShardState, TrainingState, Unit


def _recast(unit: Unit, dtype: torch.dtype, who: str) -> None:
    """Recast ``unit``'s shards to ``dtype`` (a no-op when they are in it already).

    Raises:
        RuntimeError: the unit has been gathered or its shards have gradients (a forward or
            backward ran): torch's upcast happens right after wrapping, and so must this.
    """
    if dtype == unit.dtype:
        return
    if (
        unit.meta
        or unit.shard_state is not ShardState.SHARDED
        or unit.training_state is not TrainingState.IDLE
        or any(sp.shard is not None and sp.shard.grad is not None for sp in unit.params)
    ):
        raise RuntimeError(
            f"FSDP unit {unit.name!r}: {who} changes the shards' dtype from {unit.dtype} to {dtype}; fullshard "
            "does that only right after wrapping (before the first forward, with no gradients), as Accelerate "
            "does: cast the model before wrapping it instead"
        )
    unit.recast_shards(dtype)


class FlatParamView:
    """This rank's flat shard of one wrapper's unit, as torch FSDP1's ``FlatParameter`` is read.

    ``data`` is the unit's local flat buffer (1-D, the unit's shard elements S, the shards'
    dtype, padding included); assigning a tensor of another dtype (S elements) recasts the shards
    to it and copies its values in. ``dtype``, ``device``, ``requires_grad``, ``numel()`` and
    ``_fqns`` (the parameters' names) are read-only.

    Raises:
        ValueError: ``data`` assigned a tensor that is not 1-D of S elements.
        RuntimeError: ``data`` assigned another dtype after the unit was first gathered.
    """

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    @property
    def data(self) -> torch.Tensor:
        return self._unit.local_flat

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        unit = self._unit
        if value.shape != unit.local_flat.shape:
            raise ValueError(
                f"FSDP unit {unit.name!r}: _flat_param.data takes a 1-D tensor of {unit.shard_numel} elements "
                f"(this rank's flat shard), got shape {tuple(value.shape)}"
            )
        _recast(unit, value.dtype, "_flat_param.data = ...")
        with torch.no_grad():
            unit.local_flat.copy_(value)

    @property
    def dtype(self) -> torch.dtype:
        return self._unit.dtype

    @property
    def device(self) -> torch.device:
        return self._unit.local_flat.device

    @property
    def requires_grad(self) -> bool:
        return bool(self._unit.trainable)

    @property
    def _fqns(self) -> tuple[str, ...]:
        return tuple(sp.fqn for sp in self._unit.params)

    def numel(self) -> int:
        return self._unit.shard_numel


class HandleView:
    """torch FSDP1's ``FlatParamHandle`` as frameworks touch it: ``_orig_param_dtype`` (the
    shards' dtype; setting it recasts them, as :attr:`FlatParamView.data` does) and
    ``flat_param``.

    Raises:
        RuntimeError: ``_orig_param_dtype`` set to another dtype after the unit was first gathered.
    """

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    @property
    def flat_param(self) -> FlatParamView:
        return FlatParamView(self._unit)

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        return self._unit.dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        _recast(self._unit, dtype, "_handle._orig_param_dtype = ...")
