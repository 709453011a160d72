"""Use-after-reshard guard: autograd refuses tensors saved from freed full parameters, and the
error names the FSDP unit.

While a unit's full flat buffer has no memory (resharded), the version counters of its autograd
aliases are raised by :data:`STRIDE` plus a number of the unit's own; views saved for backward
share those counters, so a backward that would read them fails in autograd's saved-tensor check ("modified by an inplace
operation ... is at version X; expected version Y") instead of reading freed memory. Once an
all-gather refills the buffer the counters go back and saved views are valid again.

Autograd names only the node that made the saved tensor (often a ``t()`` of the weight), so
:func:`install` puts a subclass of autograd's engine handle in place whose ``run_backward``
(behind ``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad``) turns that
error into one that names the freed unit, when the versions in the message are a freed unit's
(``X - Y`` is the unit's raise). Any other error passes through unchanged.

The same handle tells the hooks when a backward raised (:func:`if_backward_fails`): autograd
then drops the callback that would have ended the units' backward.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fullshard import compat
from fullshard.engine import dynamo_guard

__all__ = ["STRIDE", "install", "mark_freed", "mark_valid"]

# How far a freed buffer's version counter is raised: far beyond any count of in-place updates a
# saved tensor could have seen, so the pair of versions in autograd's message identifies it.
STRIDE = 1 << 24


class _Guarded(Protocol):
    name: str
    full_flat: torch.Tensor
    frozen_full: torch.Tensor
    _clean_versions: tuple[int, int] | None


_FREED: weakref.WeakSet[Any] = weakref.WeakSet()  # units whose full parameters are freed now
_SERIALS = itertools.count()


def _set_versions(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    """Set the autograd version counters of ``tensors`` (shared with their views)."""
    compat.set_version_counters(tensors, versions)


def _raise_of(unit: Any) -> int:
    """How far ``unit``'s counters go up while freed: :data:`STRIDE` plus a number of its own, so
    the difference autograd reports says which unit it was."""
    serial = unit.__dict__.get("_guard_serial")
    if serial is None:
        serial = unit._guard_serial = next(_SERIALS) % STRIDE
    return STRIDE + serial


def mark_freed(unit: _Guarded) -> None:
    """After ``unit``'s full buffer lost its memory: make autograd refuse tensors saved from it."""
    unit._clean_versions = (compat.version_counter(unit.full_flat), compat.version_counter(unit.frozen_full))
    up = _raise_of(unit)
    _set_versions((unit.full_flat, unit.frozen_full), tuple(v + up for v in unit._clean_versions))
    _FREED.add(unit)


def mark_valid(unit: _Guarded) -> None:
    """After an all-gather refilled ``unit``'s full buffer: saved views of it are valid again."""
    if unit._clean_versions is not None:
        _set_versions((unit.full_flat, unit.frozen_full), unit._clean_versions)
        unit._clean_versions = None
    _FREED.discard(unit)


# Units laid out again under a live forward graph: the contexts of that graph's splits.
_STALE: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


def mark_stale(unit: Any, tensors: tuple[torch.Tensor, ...], clean: tuple[int, ...], splits: list[Any]) -> None:
    """After ``unit`` was laid out again (a ``requires_grad`` changed) while a forward's graph
    still held views of its old full buffers ``tensors``: make autograd refuse them for good.
    ``clean``: their version counters before any freeing bump; ``splits``: that graph's split
    contexts (alive while the graph is)."""
    _set_versions(tensors, tuple(v + STRIDE + _raise_of(unit) for v in clean))
    _STALE.setdefault(unit, weakref.WeakSet()).update(splits)


def stale_error(name: str, error: BaseException | None = None) -> RuntimeError:
    """The error for a backward through a forward of unit ``name`` made before its layout changed."""
    return RuntimeError(
        f"FSDP unit {name!r}: backward runs through a forward made before requires_grad of the unit's "
        "parameters changed; the unit was laid out again for the change (at its next forward), and that "
        "forward's graph reads the old layout. Fix: run that forward's backward before changing "
        "requires_grad, or drop its outputs." + (f" Autograd's error: {error}" if error is not None else "")
    )


def _stale_unit_in(message: str, graph: set[Any] | None = None) -> str | None:
    """The unit laid out again that autograd's error ``message`` is about: exact from the
    versions; for a modified view of a multi-output function, a unit whose stale graph is alive
    (and among ``graph``'s nodes, the backward's, when given)."""
    found = _VERSIONS.search(message)
    if found is not None:
        raised = int(found.group(1)) - int(found.group(2))
        return next((u.name for u in list(_STALE) if raised == STRIDE + _raise_of(u)), None)
    if _VIEW.match(message) is None:
        return None
    return next((u.name for u, splits in list(_STALE.items()) if _in_graph(splits, graph)), None)


def _in_graph(splits: Any, graph: set[Any] | None) -> bool:
    """Whether any of ``splits`` (split nodes) is in ``graph`` (any, when ``graph`` is None)."""
    return any(graph is None or ctx in graph for ctx in list(splits))


def graph_nodes(roots: Any) -> set[Any] | None:
    """Every autograd node a backward from ``roots`` (the tensors or gradient edges handed to
    autograd's engine) may run, or None when ``roots`` is not such a sequence. Walked on the error
    path only: it tells the units a backward still needs from those of other, older graphs still
    alive (e.g. a model of an earlier run kept by a reference cycle)."""
    try:
        stack = [r.grad_fn if isinstance(r, torch.Tensor) else r.node for r in roots]
    except (TypeError, AttributeError):
        return None
    if not stack:
        return None
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return seen


_VERSIONS = re.compile(r"is at version (\d+); expected version (\d+)")
_VIEW = re.compile(r"^Output \d+ of (\S+) is a view and its base or another view of its base has been modified inplace")
_SPLIT_NAME = re.compile(r"^FullParametersOfFSDPUnit\[(.*)\]$")
_MAX_LISTED = 4


def freed_units_in(message: str, graph: set[Any] | None = None) -> list[str]:
    """Names of the freed units that autograd's error ``message`` may be about, most likely first.

    The saved-tensor version error gives the versions: exact. The error about a modified view of a
    multi-output function (what a saved view of the full parameters raises) names the node that made
    the view: exact when it is the unit's split, else every freed unit that autograd may still need
    (its full parameters were used under grad and their backward has not run), among the nodes of
    ``graph`` (the failing backward's: :func:`graph_nodes`) when given.
    """
    found = _VERSIONS.search(message)
    if found is not None:
        now, expected = int(found.group(1)), int(found.group(2))
        return sorted(u.name for u in list(_FREED) if now - expected == _raise_of(u))
    view = _VIEW.match(message)
    if view is None or not _FREED:
        return []
    own = _SPLIT_NAME.match(view.group(1))
    if own is not None:
        return [own.group(1)]
    return sorted(u.name for u in list(_FREED) if _in_graph(getattr(u, "_open_splits", ()), graph))


def explain(error: RuntimeError, graph: set[Any] | None = None) -> RuntimeError | None:
    """A clearer error for ``error`` when it is a use of freed full parameters (or of a layout
    since replaced: :func:`mark_stale`), else None. ``graph``: the nodes of the backward that
    raised it (:func:`graph_nodes`); None considers every unit's live graphs."""
    stale = _stale_unit_in(str(error), graph)
    if stale is not None:
        return stale_error(stale, error)
    names = freed_units_in(str(error), graph)
    if not names:
        return None
    traced = dynamo_guard.compiled_autograd_error(names[0], error)
    if traced is not None:  # compiled autograd unpacked saved tensors before the pre-backward hooks ran
        return traced
    which = " or ".join(repr(n) for n in names[:_MAX_LISTED])
    if len(names) > _MAX_LISTED:
        which += f" (or one of {len(names) - _MAX_LISTED} more)"
    return RuntimeError(
        f"FSDP unit {which}: backward needs a tensor saved from the unit's full parameters, but the unit has "
        "resharded (its full parameters are freed). This happens when a tensor computed inside the unit reaches "
        "the loss without passing through the unit's outputs (e.g. kept as a module attribute), or when backward "
        "runs after reshard() on members called after unshard(), or when a forward ran between "
        "torch.autograd.grad(..., create_graph=True) and the backward through the graph it made (a gradient "
        "penalty: run that backward first). Fix: return such tensors from the unit's "
        "forward, or keep the unit gathered until backward (reshard_after_forward=False, or unshard() before "
        f"and reshard() after backward). Autograd's error: {error}"
    )


_IF_FAILS: list[Callable[[], None]] = []  # see if_backward_fails
_depth = 0  # backward calls running (activation checkpointing's reentrant backward nests one)


def nested_backward() -> bool:
    """Whether a backward call runs inside another one now (a reentrant checkpoint's, in the
    outer backward), counted by :class:`_ExplainingEngine`."""
    return _depth > 1


def if_backward_fails(handler: Callable[[], None]) -> None:
    """Call ``handler`` if the backward running now raises, as the exception leaves the outermost
    backward call (``Tensor.backward``, ``torch.autograd.backward`` or ``grad``); forgotten when
    that call returns. A hook that queued an autograd callback registers its tidy-up here:
    autograd drops the callbacks of a backward that raised."""
    _IF_FAILS.append(handler)


class _ExplainingEngine(compat.autograd_engine_type()):  # type: ignore[misc]
    """Autograd's engine handle; a use of freed full parameters raises an error naming the unit,
    and a backward that raised runs the handlers of :func:`if_backward_fails`."""

    @dynamo_guard.never_traced
    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        global _depth
        _depth += 1
        try:
            result = self._explained(*args, **kwargs)
        except BaseException as error:
            _depth -= 1
            if _depth == 0:
                _tidy_after(error)
            raise
        _depth -= 1
        if _depth == 0:
            _IF_FAILS.clear()
        return result

    @dynamo_guard.never_traced
    def _explained(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run_backward(*args, **kwargs)
        except RuntimeError as e:
            # a view's error names no unit: those this backward's graph reads; failing that, any
            graph = graph_nodes(args[0]) if args and _VIEW.match(str(e)) else None
            clearer = explain(e, graph) or (explain(e) if graph is not None else None)
            if clearer is None:
                raise
            raise clearer from e


def _tidy_after(error: BaseException) -> None:
    """Run the handlers of :func:`if_backward_fails` for the backward that raised ``error``. One
    that raises in turn (e.g. waiting for a reduction a peer left: its error is a consequence)
    leaves ``error`` the one raised, with a note; a Ctrl-C stays a KeyboardInterrupt."""
    handlers = list(_IF_FAILS)
    _IF_FAILS.clear()
    for handler in handlers:
        try:
            handler()
        except Exception as tidy:
            error.add_note(f"fullshard: tidying up after this error failed too: {type(tidy).__name__}: {tidy}")


def install() -> None:
    """Route autograd's backward calls through :class:`_ExplainingEngine` (idempotent).

    Called when the first unit is built, so importing fullshard alone changes nothing in torch.
    """
    compat.install_autograd_engine(_ExplainingEngine)
