"""Running fullshard's forward hooks outside ``torch.inference_mode``: :func:`outside_inference_mode`.

A tensor made under ``torch.inference_mode()`` is an inference tensor for good: no in-place
update outside inference mode, never saved for backward. fullshard keeps the memory it gathers
into (the buffer pool, a unit's full flat buffer, a mixed-precision copy) and writes into it in
place at the next all-gather, so a buffer first made during an evaluation under inference mode
(Lightning's validation loop and its sanity check before training use it by default) would
break the next training step. The engine's forward-time entry points therefore run with
inference mode off and grad off: what they allocate is a normal tensor, what the model then
computes from it under inference mode is the program's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_inference_mode(fn: F) -> F:
    """``fn``, run with inference mode off (and grad off) when called under
    ``torch.inference_mode()``; called directly otherwise (one C call to check, about 0.1 us)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
