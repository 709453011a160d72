"""``ShardedGradScaler``: torch's FSDP gradient scaler, with its found-inf shared on every path.

A float16 step overflows on one rank only as often as not: after the reduce-scatter an inf sits
in the shard that owns the element, so each rank's own check sees a different answer. Every rank
must skip the step and back off the scale together, or the shards diverge silently. torch's
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` all-reduces the found-inf flag
in ``unscale_`` (which ``step`` calls for an ordinary optimizer), and works unchanged on
fullshard's shards (plain tensors under the FSDP1 wrapper, DTensors under ``fully_shard``), so
this class keeps all of it and changes two things, both on the path of optimizers whose step
unscales and skips by itself (``_step_supports_amp_scaling``: ``fused=True`` Adam, AdamW, SGD):

- ``step`` without an ``unscale_`` first checks the gradients through ``_check_inf_per_device``,
  which torch's class does not all-reduce: a rank without the inf stepped while the rank with it
  skipped, and the scales then differed between ranks. Here the flag is shared (its maximum over
  ``process_group``).
- after ``unscale_`` (for ``clip_grad_norm_``), torch's flag has shape ``(1,)`` and is a sum over
  ranks; the fused step wants a 0-dim flag equal to 1.0 to skip (torch raises "output with shape
  [] doesn't match the broadcast shape [1]"). Here the flag is 0-dim and at most 1.0.

With ordinary optimizers it does what torch's does, bitwise (``tests/test_grad_scaler.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as _TorchShardedGradScaler

from fullshard.comm import collectives


class ShardedGradScaler(_TorchShardedGradScaler):
    """Gradient scaling for float16 mixed precision over sharded gradients, as torch's
    ``ShardedGradScaler`` (same arguments, defaults, ``state_dict`` and behaviour), with the
    found-inf flag shared across ranks for fused optimizers too (see the module docstring).

    Use it as torch's: ``scaler.scale(loss).backward()``, optionally ``scaler.unscale_(opt)``
    and ``model.clip_grad_norm_(...)``, then ``scaler.step(opt)`` and ``scaler.update()``. Every
    rank of ``process_group`` must call ``unscale_`` / ``step`` (a collective).

    Args:
        device: where the scale lives: ``"cuda"`` (torch's default; on a machine without CUDA,
            torch disables the scaler with a warning and ``scale`` returns the loss unchanged) or
            ``"cpu"`` for a CPU (gloo) run.
        init_scale: the first scale (float, default 2**16).
        backoff_factor: factor on the scale after a step with inf/NaN gradients (default 0.5).
        growth_factor: factor on the scale after ``growth_interval`` clean steps (default 2.0).
        growth_interval: clean steps before the scale grows (default 2000).
        enabled: False makes ``step`` call ``optimizer.step()`` and every other method a no-op.
        process_group: the ranks sharing the found-inf flag (default: the whole world).

    Raises:
        RuntimeError: as torch's: ``unscale_`` twice before ``update``, ``unscale_`` after
            ``step``, ``step`` twice, or a ``closure`` passed to ``step``.
    """

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """Each device's found-inf flag (0-dim float32, 0.0 or 1.0) for ``optimizer``'s gradients,
        the same on every rank of ``process_group``."""
        found = super()._check_inf_per_device(optimizer)
        self._share_found_inf(found)
        return found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record (on every rank the
        same) whether any rank's were inf/NaN; see torch's ``GradScaler.unscale_``."""
        super().unscale_(optimizer)
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        # torch's flag is (1,) and summed over ranks; a fused step reads a 0-dim flag equal to 1.
        state["found_inf_per_device"] = {
            device: flag.reshape(()).clamp_(max=1.0) for device, flag in state["found_inf_per_device"].items()
        }

    def _share_found_inf(self, found: dict[Any, torch.Tensor]) -> None:
        """Replace each flag in ``found`` by its maximum over ``process_group``, in place."""
        if not collectives.is_initialized():
            return
        group = getattr(self, "process_group", None) or collectives.default_group()
        for flag in found.values():
            collectives.all_reduce_max(flag, group)


__all__ = ["ShardedGradScaler"]
