"""``use_in_torch``: fullshard's ``fully_shard`` bound in torch's names, for code that calls torch's.

Frameworks (Accelerate, the HF Trainer, Lightning, torchtune, torchtitan) call
``torch.distributed.fsdp.fully_shard`` (or the ``torch.distributed._composable.fsdp`` alias)
themselves. :func:`use_in_torch` rebinds those names to fullshard's ``fully_shard`` and
``register_fsdp_forward_method``, and the copies frameworks bound at import time (a module-level
``from torch.distributed.fsdp import fully_shard``) in the modules listed in ``FRAMEWORK_MODULES``
and in torch's pipeline stage (``PIPELINING_MODULES``: with it, ``torch.distributed.pipelining``
schedules reduce a fullshard stage's gradients once per step, see :mod:`.pipelining`). A module
imported after the call binds fullshard's function by itself. fullshard's units already
are torch ``FSDPModule`` instances, and ``fully_shard`` takes torch's ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy``, so those names stay torch's.

torch's own function stays reachable: :func:`torch_fully_shard` returns it, whether the
binding is on or off.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from fullshard import compat

# Where torch exposes the FSDP2 functions (the private ``_fully_shard`` package, which torch's
# own code imports from, is left alone).
TORCH_MODULES = (
    "torch.distributed.fsdp",
    compat.COMPOSABLE_FSDP,
    f"{compat.COMPOSABLE_FSDP}.fully_shard",
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
# torch's pipeline stage, which reads a stage module's state through ``fully_shard.state`` at
# its REDUCE_GRAD action (fullshard's answers for its units: :mod:`.pipelining`).
PIPELINING_MODULES = ("torch.distributed.pipelining.stage",)
# FSDP1's wrapper class, bound only with use_in_torch(fsdp1=True) (Lightning's FSDPStrategy
# imports it from these modules inside its methods).
FSDP1_MODULES = ("torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel")
_GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # group -> (modules, names)
    "fsdp2": (TORCH_MODULES + FRAMEWORK_MODULES + PIPELINING_MODULES, ("fully_shard", "register_fsdp_forward_method")),
    "fsdp1": (FSDP1_MODULES, ("FullyShardedDataParallel",)),
}

_originals: dict[str, Any] = {}  # name -> torch's object (kept from the first binding on)
_depth = {group: 0 for group in _GROUPS}  # use_in_torch() calls not yet undone, per group


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
    from fullshard.frontend.forward_method import register_fsdp_forward_method

    if hooks.is_unit(module):
        register_fsdp_forward_method(module, method_name)
    else:
        _originals["register_fsdp_forward_method"](module, method_name)


def _ours() -> dict[str, Any]:
    from fullshard.frontend.fsdp1 import FullyShardedDataParallel
    from fullshard.frontend.fully_shard import fully_shard

    return {
        "fully_shard": fully_shard,
        "register_fsdp_forward_method": _register_fsdp_forward_method,
        "FullyShardedDataParallel": FullyShardedDataParallel,
    }


def _rebind(group: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """In the group's loaded modules, set ``<name>`` to ``new[name]`` where it is ``old[name]``
    (bindings others made are left alone)."""
    modules, names = _GROUPS[group]
    for module in (sys.modules[n] for n in modules if n in sys.modules):
        for name in names:
            if getattr(module, name, None) is old[name]:
                setattr(module, name, new[name])


class TorchBinding:
    """What :func:`use_in_torch` returns: ``undo()`` (or leaving a ``with`` block) gives torch
    its own functions back once every call has been undone."""

    def __init__(self, groups: tuple[str, ...]) -> None:
        self._groups = groups
        self._done = False

    def undo(self) -> None:
        """Undo this call (a second undo does nothing)."""
        if self._done:
            return
        self._done = True
        for group in self._groups:
            _depth[group] -= 1
            if _depth[group] == 0:
                _rebind(group, _ours(), _originals)

    def __enter__(self) -> TorchBinding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def use_in_torch(*, fsdp1: bool = False) -> TorchBinding:
    """Make code that calls torch's FSDP2 functions run on fullshard (opt-in, reversible).

    Rebinds ``fully_shard`` and ``register_fsdp_forward_method`` in
    ``torch.distributed.fsdp`` and ``torch.distributed._composable.fsdp`` (and its
    ``fully_shard`` module) to fullshard's, and the copies that the framework modules in
    ``FRAMEWORK_MODULES`` (torchtune, transformers, torchtitan) and torch's pipeline stage
    (``torch.distributed.pipelining.stage``, needed by its schedules with fullshard's units)
    bound at import time. Call it before the framework shards the model; code that bound
    torch's function in its own module before the call keeps torch's. The rebound
    ``register_fsdp_forward_method`` serves fullshard's units and torch's. Calling it again while
    on changes nothing (each call is undone separately; torch gets its functions back after the
    last undo).

    Args:
        fsdp1: also bind fullshard's ``FullyShardedDataParallel`` as
            ``torch.distributed.fsdp.FullyShardedDataParallel`` (and in
            ``torch.distributed.fsdp.fully_sharded_data_parallel``), for frameworks that wrap
            with torch's FSDP1 class (Lightning's ``FSDPStrategy``). While it is on, torch's own
            FSDP1 cannot be used through those names.

    Returns:
        a :class:`TorchBinding`: call ``undo()`` or use it in a ``with`` block to give torch
        its functions back (framework modules imported meanwhile included).

    Raises:
        ImportError: torch has no ``torch.distributed.fsdp.fully_shard`` (torch < 2.6).
    """
    compat.import_composable_fsdp()  # loads every module in TORCH_MODULES
    import torch.distributed.fsdp
    import torch.distributed.fsdp.fully_sharded_data_parallel  # noqa: F401

    groups = ("fsdp2", "fsdp1") if fsdp1 else ("fsdp2",)
    for group in groups:
        if _depth[group] == 0:
            for name in _GROUPS[group][1]:
                _originals.setdefault(name, getattr(torch.distributed.fsdp, name))
            _rebind(group, _originals, _ours())
        _depth[group] += 1
    return TorchBinding(groups)


def reset() -> None:
    """Give torch its functions back, however many :func:`use_in_torch` calls are not undone
    (a test harness's fresh start in a kept process)."""
    for group in _GROUPS:
        if _depth[group]:
            _depth[group] = 0
            _rebind(group, _ours(), _originals)


def active(group: str = "fsdp2") -> bool:
    """Whether :func:`use_in_torch` is on (``"fsdp1"``: with ``fsdp1=True``)."""
    return _depth[group] > 0
