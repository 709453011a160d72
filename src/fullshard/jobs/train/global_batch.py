"""``--global-batch-size``: the same training at any world size, by gradient accumulation.

Without it a step trains on ``--batch-size`` sequences per rank, so the global batch (and the
loss curve) depends on the world size. With ``--global-batch-size G`` a step trains on G
sequences fixed by the step and the seed alone; each rank takes ``--batch-size`` of them per
micro-batch and accumulates ``G / (world size x batch size)`` micro-batches without
communication (``no_sync`` / ``set_requires_gradient_sync(False)``) before the last one
reduce-scatters. An elastic job that goes from 2 ranks to 1 and back therefore follows the loss
curve of an uninterrupted run; only the order of floating-point sums differs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--global-batch-size``."""
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        metavar="G",
        help="sequences per optimizer step over all ranks, fixed whatever the world size "
        "(gradient accumulation makes up the difference; default: --batch-size x world size)",
    )


def valid_world_sizes(global_batch: int, micro_batch: int) -> list[int]:
    """World sizes W for which ``global_batch`` is a whole number of W x ``micro_batch``."""
    if global_batch % micro_batch:
        return []
    per_step = global_batch // micro_batch
    return [w for w in range(1, per_step + 1) if per_step % w == 0]


def validate(cfg: Any, world_size: int | None = None) -> None:
    """Check ``cfg.global_batch_size`` against ``cfg.batch_size`` and, if given, ``world_size``.

    Raises:
        ValueError: G < 1, or G is not a multiple of world size x ``--batch-size``; the message
            names the valid world sizes.
    """
    g = cfg.global_batch_size
    if g is None:
        return
    if g < 1:
        raise ValueError(f"--global-batch-size must be at least 1, got {g}")
    valid = valid_world_sizes(g, cfg.batch_size)
    if not valid:
        raise ValueError(
            f"--global-batch-size {g} is not a multiple of --batch-size {cfg.batch_size} (the micro-batch "
            "per rank): choose G = batch size x world size x accumulation steps"
        )
    if world_size is not None and world_size not in valid:
        raise ValueError(
            f"--global-batch-size {g} with --batch-size {cfg.batch_size} needs a world size in "
            f"{valid} (G divisible by world size x batch size); this run has {world_size} ranks"
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one optimizer step is split: ``accumulation`` micro-batches of ``micro_batch`` rows on
    each of ``world_size`` ranks, ``global_batch`` rows in all."""

    global_batch: int
    micro_batch: int
    world_size: int
    accumulation: int

    def rows(self, rank: int, micro: int) -> slice:
        """The rows of the step's global batch that ``rank`` trains on in micro-batch ``micro``."""
        start = (micro * self.world_size + rank) * self.micro_batch
        return slice(start, start + self.micro_batch)


def plan(cfg: Any, world_size: int) -> Plan | None:
    """The accumulation plan for ``world_size`` ranks, or None without ``--global-batch-size``.

    Raises:
        ValueError: as :func:`validate`.
    """
    validate(cfg, world_size)
    g = cfg.global_batch_size
    if g is None:
        return None
    return Plan(g, cfg.batch_size, world_size, g // (world_size * cfg.batch_size))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the context, backward reduces gradients only if ``enabled`` (else it accumulates
    them unsharded on this rank): the FSDP1 wrapper's ``no_sync()`` or FSDP2's
    ``set_requires_gradient_sync``."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):
        with model.no_sync():  # type: ignore[operator]
            yield
    else:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]


def accumulate(
    model: nn.Module,
    p: Plan,
    rank: int,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches of one step's global ``batch``.

    Args:
        batch: (inputs, targets) of the whole step, each with ``p.global_batch`` rows.
        loss_fn: ``(model, inputs, targets) -> mean loss`` (a 0-d float tensor).

    Returns:
        This rank's loss, the mean over its micro-batches (detached, 0-d). Gradients hold
        1 / (world size x accumulation) of the sum of the micro-batch gradients after FSDP's
        averaging reduce-scatter: the gradient of the global batch's mean loss.
    """
    x, y = batch
    total = torch.zeros((), device=x.device)
    for micro in range(p.accumulation):
        rows = p.rows(rank, micro)
        with gradient_sync(model, micro == p.accumulation - 1):
            loss = loss_fn(model, x[rows], y[rows]) / p.accumulation
            loss.backward()
        total += loss.detach()
    return total
