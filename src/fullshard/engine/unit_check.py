"""The first forward's check that every rank wraps the same units, set up the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fullshard.comm import collectives, flight_recorder
from fullshard.engine.unit import Unit
from fullshard.engine.unit_config import UnitConfig


def _wire_settings(config: UnitConfig) -> tuple[str, ...]:
    """The settings of a unit that decide what its collectives carry and how many there are,
    as "name=value" strings: ranks that differ in them would pair mismatched buffers (a crash,
    or, where the sizes happen to agree, silently wrong values)."""
    return (
        f"reshard_after_forward={config.reshard_after_forward}",
        f"param_dtype={config.param_dtype}",
        f"reduce_dtype={config.reduce_dtype}",
        f"comm_quantization={config.comm_quantization!r}",
    )


def _prefix(unit: Unit) -> str:
    """What turns the unit-relative names of ``unit``'s parameters into the model's."""
    return "" if not unit.name or unit.name.startswith("<") else f"{unit.name}."  # "<root>": names are the model's


def _frozen(unit: Unit) -> tuple[str, ...]:
    """The names of ``unit``'s parameters that do not require gradients: ranks that differ in them
    lay out and reduce different gradients (a mismatch at the first backward)."""
    return tuple(_prefix(unit) + sp.fqn for sp in unit.params if not sp.requires_grad)


def _param_shapes(unit: Unit) -> tuple[str, ...]:
    """Each of ``unit``'s parameters as "name: shape dtype", in layout order: ranks whose units
    agree in byte size can still differ in these (a 4x4 weight against a 2x8 one, bf16 against
    fp16), and would then gather and reduce one rank's values into the other's shapes."""
    return tuple(f"{_prefix(unit)}{sp.fqn}: {tuple(sp.spec.orig_shape)} {sp.local.dtype}" for sp in unit.params)


def _raise_shapes_differ(unit: str, shapes: list[tuple[str, ...]]) -> None:
    """Raise for unit ``unit`` whose parameters' shapes or dtypes (per rank, ``shapes``) differ."""
    k = first_difference([list(s) for s in shapes])
    seen = per_rank([list(s) for s in shapes], k, str, "no such parameter")
    raise RuntimeError(
        f"FSDP unit {unit!r} holds parameters of different shapes or dtypes across ranks, at parameter #{k} "
        f"({seen}): every rank must build the same model, with the same shapes and dtypes, before wrapping "
        "(rank-dependent model code?)"
    )


def _raise_frozen_differ(unit: str, frozen: list[tuple[str, ...]]) -> None:
    """Raise for unit ``unit`` whose frozen parameters (per rank, ``frozen``) differ across ranks."""
    names = sorted({n for f in frozen for n in f})
    first = next(n for n in names if len({n in f for f in frozen}) > 1)
    where = "; ".join(
        f"rank {r}: " + (f"frozen: {', '.join(f)}" if f else "all trainable") for r, f in enumerate(frozen)
    )
    frozen_on = [r for r, f in enumerate(frozen) if first in f]
    trainable_on = [r for r, f in enumerate(frozen) if first not in f]
    raise RuntimeError(
        f"FSDP unit {unit!r} has different trainable parameters across ranks: parameter {first!r} has "
        f"requires_grad=False on rank(s) {frozen_on} and True on rank(s) {trainable_on} ({where}): every rank "
        "must freeze the same parameters (requires_grad_(False)) before wrapping (rank-dependent code?)"
    )


def first_difference(every: list[list[Any]]) -> int:
    """The first index at which the ranks' lists (``every[r]``, one per rank, not all equal)
    differ; a list that ended counts as None there."""
    return next(k for k in range(max(map(len, every))) if len({repr(e[k]) if k < len(e) else None for e in every}) > 1)


def per_rank(every: list[list[Any]], k: int, describe: Callable[[Any], str], missing: str) -> str:
    """``rank 0: <describe(every[0][k])>; rank 1: ...``, ``missing`` for a rank whose list ended."""
    return "; ".join(f"rank {r}: " + (describe(e[k]) if k < len(e) else missing) for r, e in enumerate(every))


def check_same_units(units: list[Unit]) -> None:
    """At the first forward: every rank of the root's data-parallel group must wrap the same
    units, in the same order, of the same sizes, holding parameters of the same shapes and dtypes,
    with the same sharding strategy, mixed precision,
    ``comm_quantization`` and frozen (``requires_grad=False``) parameters; else their collectives
    would pair up wrongly or hang.

    The group is the root unit's shard group, else its replicate group; with neither (one rank)
    there is nothing to compare. Never the whole world: a mesh may be a slice of a bigger one
    whose other ranks (other pipeline stages) hold other models.

    Raises:
        RuntimeError: on every rank, naming the first unit that differs and, per rank, what
            differs (its name and size, its settings, which parameters are frozen, or a
            parameter's shape or dtype).
    """
    first = units[0]
    group = first.shard_group if first.shard_group is not None else first.replicate_group
    if group is None or collectives.group_size(group) == 1:
        return
    mine = [(u.name, u.full_nbytes, _wire_settings(u.config), _frozen(u), _param_shapes(u)) for u in units]
    with flight_recorder.at(phase="unit order check"):
        every = collectives.all_gather_object(mine, group)
    if all(units == every[0] for units in every):
        return
    i = first_difference(every)
    shapes = {units[i][:2] if i < len(units) else None for units in every}
    if len(shapes) == 1 and len({units[i][2] for units in every}) == 1:  # the same settings
        if len({units[i][3] for units in every}) > 1:  # requires_grad differs
            _raise_frozen_differ(every[0][i][0], [units[i][3] for units in every])
        _raise_shapes_differ(every[0][i][0], [units[i][4] for units in every])
    if len(shapes) == 1:  # the same unit everywhere, set up differently
        differ = [k for k in range(len(every[0][i][2])) if len({units[i][2][k] for units in every}) > 1]
        seen = "; ".join(f"rank {r}: " + ", ".join(units[i][2][k] for k in differ) for r, units in enumerate(every))
        raise RuntimeError(
            f"FSDP unit {every[0][i][0]!r} is set up differently across ranks ({seen}): every rank must pass "
            "the same sharding strategy, mixed_precision and comm_quantization (rank-dependent arguments?)"
        )
    seen = per_rank(every, i, lambda u: f"{u[0]!r} ({u[1]} bytes)", "no such unit")
    raise RuntimeError(
        f"FSDP units differ across ranks at unit #{i} in construction order ({seen}): every rank must wrap "
        "the same model with the same policy (rank-dependent model code or wrapping?)"
    )
