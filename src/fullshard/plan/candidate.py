"""One FSDP configuration the planner can choose (:class:`Candidate`), how it is applied to a
model, and every candidate for a list of blocks (:func:`candidates`); see
:mod:`fullshard.plan.planner` for what each setting trades.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: NO_SHARD or FULL_SHARD with ``keep_gathered`` blocks kept gathered
    after forward, ``checkpoint`` blocks recomputed in backward, forward prefetch or not;
    ``all_units`` are the blocks (the auto-wrap policy's units, forward order) and ``group``
    how many consecutive ones make one unit (the last may have fewer); ``offload``: CPU offload
    of shards, gradients and the optimizer step (CUDA)."""

    no_shard: bool
    keep_gathered: tuple[str, ...]
    checkpoint: tuple[str, ...]
    forward_prefetch: bool
    all_units: tuple[str, ...]
    group: int = 1
    offload: bool = False

    @property
    def groups(self) -> list[tuple[str, ...]]:
        """The units: blocks in chunks of ``group`` (one each for NO_SHARD)."""
        size = 1 if self.no_shard else self.group
        return [self.all_units[i : i + size] for i in range(0, len(self.all_units), size)]

    @property
    def n_units(self) -> int:
        return len(self.groups)

    def describe(self) -> str:
        n, kept = self.n_units, sum(g[0] in self.keep_gathered for g in self.groups)
        grouped = f" ({n} units of {self.group} blocks)" if n < len(self.all_units) else ""
        grouped = f" (one unit of all {len(self.all_units)} blocks)" if n == 1 and grouped else grouped
        if self.no_shard:
            shard = "NO_SHARD"
        elif kept >= n:
            shard = "SHARD_GRAD_OP" + grouped
        elif not kept:
            shard = "FULL_SHARD" + grouped
        else:
            shard = f"FULL_SHARD{grouped}, last {kept}/{n} units SHARD_GRAD_OP"
        noun = "blocks" if grouped else "units"
        ac = f", AC on {len(self.checkpoint)}/{len(self.all_units)} {noun}" if self.checkpoint else ""
        return (
            shard
            + ac
            + (", forward prefetch" if self.forward_prefetch else "")
            + (", CPU offload" if self.offload else "")
        )

    def apply(
        self,
        model: nn.Module,
        param_dtype: torch.dtype | None = None,
        *,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device: torch.device | None = None,
    ) -> nn.Module:
        """Wrap ``model`` (unwrapped; the units' names as planned) as planned and return it:
        activation checkpointing on the planned units, then NO_SHARD by the FSDP1 wrapper, or
        ``fully_shard`` on each unit (``reshard_after_forward`` as planned) and the root.
        ``param_dtype``: mixed precision (gathers, compute, reductions) for every module, BatchNorm
        included (the wrapper gets ``_module_classes_to_ignore=()``). A model on the meta
        device is materialized on ``device`` (default CPU) by ``param_init_fn`` (called on every
        module): the wrapper's ``param_init_fn``, or ``to_empty`` then ``param_init_fn`` on the
        DTensor shards after ``fully_shard``; without it the parameters must be on the device.

        Raises:
            AttributeError: a planned unit's name is not a submodule of ``model``.
        """
        from fullshard.engine.config import MixedPrecision, ShardingStrategy
        from fullshard.frontend.activation_checkpointing import apply_activation_checkpointing
        from fullshard.frontend.fsdp1 import FSDP
        from fullshard.frontend.wrap import lambda_auto_wrap_policy

        units = {n: model.get_submodule(n) for n in self.all_units}
        if self.checkpoint:
            chosen = {id(units[n]) for n in self.checkpoint}
            apply_activation_checkpointing(model, check_fn=lambda m: id(m) in chosen)
        dtype = param_dtype
        if self.no_shard:
            # every module in param_dtype, as the estimate has it: no BatchNorm units of the
            # wrapper's own (MixedPrecision._module_classes_to_ignore), which the plan does not hold
            mp = MixedPrecision(dtype, dtype, dtype, _module_classes_to_ignore=()) if dtype is not None else None
            planned = {id(m) for m in units.values()}  # the planned modules, not all of their class
            policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in planned)
            init: dict[str, Any] = {}
            if param_init_fn is not None:
                init["param_init_fn"] = param_init_fn
                init["device_id"] = device if device is not None and device.type == "cuda" else None
            return FSDP(
                model, sharding_strategy=ShardingStrategy.NO_SHARD, auto_wrap_policy=policy, mixed_precision=mp, **init
            )
        self._fully_shard(model, units, dtype)
        if param_init_fn is not None:
            model.to_empty(device=device or torch.device("cpu"))
            for module in model.modules():
                param_init_fn(module)
        return model

    def _fully_shard(self, model: nn.Module, units: dict[str, nn.Module], dtype: torch.dtype | None) -> None:
        """``fully_shard`` on each planned unit (a list of blocks for a group) and on the root."""
        from fullshard.frontend.fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(dtype, dtype)} if dtype is not None else {}
        if self.offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for group in self.groups:
            members = [units[n] for n in group]
            fully_shard(
                members if len(members) > 1 else members[0],
                reshard_after_forward=group[0] not in self.keep_gathered,
                **kw,
            )
        fully_shard(model, **kw)
        if self.forward_prefetch:
            order: list[Any] = [units[g[0]] for g in self.groups]
            for unit, following in zip(order, order[1:]):
                unit.set_modules_to_forward_prefetch([following])


def group_sizes(n: int) -> list[int]:
    """Blocks per unit tried for ``n`` blocks: 1, 2, 4 and all of them (those up to ``n``)."""
    return sorted({g for g in (1, 2, 4, n) if 1 <= g <= n})


def candidates(
    names: list[str], prefetch: bool = True, grouping: bool = True, offload: bool = False
) -> list[Candidate]:
    """Every candidate for blocks ``names`` (the outermost units, forward order; the root
    excluded), each with AC on the first 0..n blocks: NO_SHARD, and FULL_SHARD per
    :func:`group_sizes` (``grouping``; else one block per unit) with the last 0..all units kept
    gathered, forward prefetch off / on (``prefetch``), each of these also with CPU offload
    (``offload``)."""
    n, out, every = len(names), [], tuple(names)
    for k in range(n + 1):
        ac = every[:k]
        out.append(Candidate(True, (), ac, False, every))  # NO_SHARD gathers nothing to prefetch
        for fp in (False, True) if prefetch else (False,):
            for g in group_sizes(n) if grouping else [1]:
                units = [every[i : i + g] for i in range(0, n, g)]
                for m in range(len(units) + 1):
                    kept = tuple(b for u in units[len(units) - m :] for b in u)
                    out.append(Candidate(False, kept, ac, fp, every, g))
                    if offload:
                        out.append(Candidate(False, kept, ac, fp, every, g, offload=True))
    return out
