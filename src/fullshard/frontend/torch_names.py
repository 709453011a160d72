"""``use_in_torch``: fullshard's ``fully_shard`` bound in torch's names, for code that calls torch's.

Frameworks (Accelerate, the HF Trainer, Lightning, torchtune, torchtitan) call
``torch.distributed.fsdp.fully_shard`` (or the ``torch.distributed._composable.fsdp`` alias)
themselves. :func:`use_in_torch` rebinds those names to fullshard's ``fully_shard`` and
``register_fsdp_forward_method``, and the copies frameworks bound at import time (a module-level
``from torch.distributed.fsdp import fully_shard``) in the modules listed in ``FRAMEWORK_MODULES``.
A module imported after the call binds fullshard's function by itself. fullshard's units already
are torch ``FSDPModule`` instances, and ``fully_shard`` takes torch's ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy``, so those names stay torch's.

torch's own function stays reachable: :func:`torch_fully_shard` returns it, whether the
binding is on or off.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from torch import nn

# Where torch exposes the FSDP2 functions (the private ``_fully_shard`` package, which torch's
# own code imports from, is left alone).
TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
# Framework modules that bind torch's functions at import time (checked for these versions:
# torchtune 0.6, transformers 5.24, torchtitan 0.3; Accelerate and Lightning import them inside
# functions, so the torch modules above cover them).
FRAMEWORK_MODULES = (
    "torchtune.training._distributed",
    "transformers.distributed.fsdp",
    "torchtitan.distributed.fsdp",
    "torchtitan.models.flux.parallelize",
    "torchtitan.experiments.transformers_modeling_backend.parallelize",
)
_NAMES = ("fully_shard", "register_fsdp_forward_method")

_originals: dict[str, Any] = {}  # name -> torch's function (kept from the first use_in_torch on)
_depth = 0  # use_in_torch() calls not yet undone


def torch_fully_shard() -> Any:
    """torch's own ``torch.distributed.fsdp.fully_shard``, also while :func:`use_in_torch` is on."""
    if "fully_shard" in _originals:
        return _originals["fully_shard"]
    import torch.distributed.fsdp

    return torch.distributed.fsdp.fully_shard


def _register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """torch's ``register_fsdp_forward_method`` for every module: fullshard's for fullshard's
    units, torch's for torch's, nothing for a module neither sharded (as torch's does)."""
    from fullshard.engine import hooks
    from fullshard.frontend.fully_shard import register_fsdp_forward_method

    if hooks.is_unit(module):
        register_fsdp_forward_method(module, method_name)
    else:
        _originals["register_fsdp_forward_method"](module, method_name)


def _ours() -> dict[str, Any]:
    from fullshard.frontend.fully_shard import fully_shard

    return {"fully_shard": fully_shard, "register_fsdp_forward_method": _register_fsdp_forward_method}


def _rebind(module: types.ModuleType, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Set ``module.<name>`` to ``new[name]`` where it is ``old[name]`` (leave others' bindings)."""
    for name in _NAMES:
        if getattr(module, name, None) is old[name]:
            setattr(module, name, new[name])


def _loaded(names: tuple[str, ...]) -> list[types.ModuleType]:
    return [sys.modules[n] for n in names if n in sys.modules]


class TorchBinding:
    """What :func:`use_in_torch` returns: ``undo()`` (or leaving a ``with`` block) gives torch
    its own functions back once every call has been undone."""

    def __init__(self) -> None:
        self._done = False

    def undo(self) -> None:
        """Undo this call (a second undo does nothing)."""
        global _depth
        if self._done:
            return
        self._done = True
        _depth -= 1
        if _depth == 0:
            ours = _ours()
            for module in _loaded(TORCH_MODULES + FRAMEWORK_MODULES):
                _rebind(module, ours, _originals)

    def __enter__(self) -> TorchBinding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def use_in_torch() -> TorchBinding:
    """Make code that calls torch's FSDP2 functions run on fullshard (opt-in, reversible).

    Rebinds ``fully_shard`` and ``register_fsdp_forward_method`` in
    ``torch.distributed.fsdp`` and ``torch.distributed._composable.fsdp`` (and its
    ``fully_shard`` module) to fullshard's, and the copies that the framework modules in
    ``FRAMEWORK_MODULES`` (torchtune, transformers, torchtitan) bound at import time. Call it
    before the framework shards the model; code that bound torch's function in its own module
    before the call keeps torch's. The rebound ``register_fsdp_forward_method`` serves
    fullshard's units and torch's. Calling it again while on changes nothing (each call is
    undone separately; torch gets its functions back after the last undo).

    Returns:
        a :class:`TorchBinding`: call ``undo()`` or use it in a ``with`` block to give torch
        its functions back (framework modules imported meanwhile included).

    Raises:
        ImportError: torch has no ``torch.distributed.fsdp.fully_shard`` (torch < 2.6).
    """
    global _depth
    import torch.distributed._composable.fsdp  # noqa: F401  (loads every module in TORCH_MODULES)
    import torch.distributed.fsdp

    if _depth == 0:
        if not _originals:
            _originals.update({name: getattr(torch.distributed.fsdp, name) for name in _NAMES})
        ours = _ours()
        for module in _loaded(TORCH_MODULES + FRAMEWORK_MODULES):
            _rebind(module, _originals, ours)
    _depth += 1
    return TorchBinding()


def active() -> bool:
    """Whether :func:`use_in_torch` is on."""
    return _depth > 0
