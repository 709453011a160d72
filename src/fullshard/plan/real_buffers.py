"""The values of a model's buffers without its parameters, for the modules calibration runs.

Calibration builds the model on the meta device and materializes one unit (or the root with
stand-ins for its units) at a time with ``to_empty``: parameters get random values, which
timing allows, but buffers would hold whatever memory was there, and an index buffer (BERT's
``position_ids`` and ``token_type_ids``) then indexes out of bounds. :func:`buffer_values`
builds the model once more on the CPU with each parameter moved to the meta device as it is
registered (its storage allocated uninitialized and dropped at once; the initializers that run
after registration run on meta), so the buffers an ``__init__`` computes are real, and
:func:`fill_buffers` copies them into a materialized module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fullshard import compat


def buffer_values(make_model: Callable[[], nn.Module]) -> dict[str, torch.Tensor] | None:
    """``make_model()``'s buffers by name, real on the CPU, built with no parameter kept (see the
    module docstring); None, with a warning, where the model cannot be built that way (its
    ``__init__`` computes with a parameter and a buffer together): the buffers are then zeros."""
    try:
        with torch.device("cpu"), _parameters_on_meta():
            model = make_model()
    except Exception as err:  # noqa: BLE001 (any failure of user code: fall back to zeros, said)
        warnings.warn(
            f"calibration could not build the model's buffers for real ({type(err).__name__}: {err}); "
            "it times the model with zeros in them",
            stacklevel=2,
        )
        return None
    return {name: b for name, b in model.named_buffers() if b.device.type != "meta"}


def fill_buffers(module: nn.Module, values: dict[str, torch.Tensor] | None, prefix: str = "") -> None:
    """Copy ``values`` (:func:`buffer_values`, the whole model's) into ``module``'s buffers,
    ``module`` being the model's submodule ``prefix`` ("" for the model), materialized; a
    buffer without a value is zeroed."""
    lead = f"{prefix}." if prefix else ""
    with torch.no_grad():
        for name, b in module.named_buffers():
            value = None if values is None else values.get(lead + name)
            if value is not None and value.shape == b.shape:
                b.copy_(value)
            else:
                b.zero_()


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside moves to the meta device (accelerate's
    ``init_empty_weights(include_buffers=False)`` habit)."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = compat.module_parameters(module).get(name)
        if p is not None and p.device.type != "meta":
            compat.module_parameters(module)[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
