"""Running fullshard's hooks outside ``torch.compile``: :func:`outside_dynamo`; and refusing
compiled autograd: :func:`compiled_autograd_error`.

The marking waits for dynamo's import (2.6 s per process here), so a program that never compiles
does not pay for it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from fullshard import compat, deferred_import

F = TypeVar("F", bound=Callable[..., Any])


class _Eager:
    """What one :func:`outside_dynamo` wrapper calls: the function itself until dynamo is
    imported, then its dynamo-disabled wrapper."""

    __slots__ = ("call", "fn", "__weakref__")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = self.call = fn


_EAGER: weakref.WeakSet[_Eager] = weakref.WeakSet()  # every wrapper's, alive


def _disable_under_dynamo() -> None:
    """Once dynamo is imported: every wrapper's frames are skipped (they share one code object)
    and each calls its function through ``torch._dynamo.disable``."""
    compat.dynamo_skip_frames_of(_CALL_CODE)
    for eager in list(_EAGER):
        eager.call = compat.dynamo_disable(eager.fn)


def outside_dynamo(fn: F) -> F:
    """``fn``, never traced by ``torch.compile``: it and everything it calls run eagerly.

    fullshard's hooks gather and free memory, issue collectives (some of Python objects), read
    clocks, take locks and compare data pointers: none of that belongs in a graph, and dynamo
    cannot trace most of it. Registered as a module hook, ``fn`` is skipped by a compiled
    block's ``_call_impl`` and by a compiled model (which breaks its graph at the call, once
    per unit boundary), as torch's FSDP2 hooks are.

    Marking a function for dynamo imports dynamo, 2.6 s per process here (most of what importing
    fullshard cost), which a program that never compiles does not need. So the marking waits
    for dynamo: the wrapper calls ``fn`` directly until something imports dynamo (a
    ``torch.compile``), and from then on dynamo skips the wrapper's frames and the wrapper calls
    ``fn`` through dynamo's disable (:func:`fullshard.deferred_import.after_import`). Costs about 0.2 us per call
    before, 2 us after.
    """
    eager = _Eager(fn)
    if _DYNAMO_IMPORTED:
        eager.call = compat.dynamo_disable(fn)
    _EAGER.add(eager)
    return functools.wraps(fn)(_calling(eager))  # type: ignore[return-value]


def _calling(eager: _Eager | None) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return eager.call(*args, **kwargs)  # type: ignore[union-attr]

    return call


_CALL_CODE = _calling(None).__code__  # the code object of every outside_dynamo wrapper
_DYNAMO_IMPORTED = False
_UNTRACED: list[Any] = [_CALL_CODE]  # code objects whose frames dynamo runs as they are


def never_traced(fn: F) -> F:
    """``fn`` unchanged, but dynamo runs its frames as they are and never compiles them; unlike
    :func:`outside_dynamo`, the frames ``fn`` calls stay dynamo's to decide.

    For fullshard code that Python reaches from inside a compiled function's eager part without
    being a hook: the autograd engine handle's ``run_backward`` (a compiled training step calls
    ``loss.backward()`` there), whose callees include the user's own backward hooks.
    """
    _UNTRACED.append(fn.__code__)
    if _DYNAMO_IMPORTED:
        compat.dynamo_skip_frames_of(fn.__code__)
    return fn


def _on_dynamo_import() -> None:
    global _DYNAMO_IMPORTED
    _DYNAMO_IMPORTED = True
    for code in _UNTRACED[1:]:
        compat.dynamo_skip_frames_of(code)
    _disable_under_dynamo()


deferred_import.after_import(compat.DYNAMO, _on_dynamo_import)


def compiled_autograd_error(unit_name: str, error: BaseException | None = None) -> RuntimeError | None:
    """The error for a backward through unit ``unit_name`` under compiled autograd, or None when
    compiled autograd is off.

    Compiled autograd traces the whole backward graph before running any of it: it unpacks the
    tensors saved from a unit's full parameters while the unit is still resharded (freed), and
    calls fullshard's backward hooks, which gather parameters and reduce gradients eagerly, from
    inside its graph. Neither works; torch 2.13's own ``fully_shard`` (no compiled-autograd
    support left in it) trains to other numbers than eager under it. So a fullshard backward
    under compiled autograd fails at once, naming it, rather than from a freed-memory check or
    with wrong gradients.
    """
    if not compat.compiled_autograd_on():
        return None
    return RuntimeError(
        f"FSDP unit {unit_name!r}: backward under compiled autograd (torch._dynamo.config.compiled_autograd=True "
        "or torch._dynamo.compiled_autograd._enable) is not supported: it traces the backward before fullshard's "
        "hooks gather the unit's parameters and reduce its gradients. Fix: run backward without compiled "
        "autograd; a torch.compile'd block or model still gets a compiled backward (AOT autograd)."
        + (f" Autograd's error: {error}" if error is not None else "")
    )
