"""``--plan auto --memory-budget SIZE``: the GPT, MNIST and HF jobs let fullshard choose the
FSDP configuration (sharding per unit, activation checkpointing, forward prefetch, front end).

At start-up every rank calibrates this machine for a few seconds (collectives at the job's world
size, each unit at the job's micro-batch, the job's optimizer), rank 0 runs :func:`fullshard.planning.plan`
under the budget, prints the plan and hands it to every rank, and each rank wraps the model as
planned. When nothing fits, every rank fails with the smallest budget that would.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PLANS = ("none", "auto")
_CHOSEN_BY_THE_PLAN = (
    ("--sharding-strategy", lambda cfg: cfg.sharding_strategy != "full_shard"),
    ("--activation-checkpointing", lambda cfg: getattr(cfg, "activation_checkpointing", False)),
    ("--forward-prefetch", lambda cfg: cfg.forward_prefetch),
    ("--cpu-offload", lambda cfg: cfg.cpu_offload),
    ("--api fsdp2", lambda cfg: cfg.api != "fsdp1"),
    ("--backward-prefetch", lambda cfg: cfg.backward_prefetch != "pre"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add --plan and --memory-budget."""
    p.add_argument(
        "--plan",
        default="none",
        choices=PLANS,
        help="auto: choose sharding, activation checkpointing and prefetch for --memory-budget",
    )
    p.add_argument("--memory-budget", default=None, metavar="SIZE", help="--plan auto: bytes per rank, e.g. 8GiB")


def validate(cfg: Any) -> None:
    """Check ``cfg.plan`` and ``cfg.memory_budget`` against the other FSDP options.

    Raises:
        ValueError: an unknown plan; ``--memory-budget`` missing, malformed or given without
            ``--plan auto``; or an option the plan chooses itself also given, naming it.
    """
    from fullshard.planning import parse_size

    if cfg.plan not in PLANS:
        raise ValueError(f"--plan {cfg.plan!r}: use none or auto")
    if cfg.plan == "none":
        if cfg.memory_budget is not None:
            raise ValueError("--memory-budget is the budget of --plan auto: add --plan auto, or drop it")
        return
    if cfg.memory_budget is None:
        raise ValueError("--plan auto needs --memory-budget SIZE (bytes per rank, e.g. 8GiB)")
    try:
        parse_size(cfg.memory_budget)
    except ValueError as e:
        raise ValueError(f"--memory-budget: {e}") from None
    if getattr(cfg, "comm_quant", "none").strip().lower() != "none":
        raise ValueError(
            "--plan auto with --comm-quant: the planner times and applies exact collectives only; drop one of them"
        )
    given = [flag for flag, is_set in _CHOSEN_BY_THE_PLAN if is_set(cfg)]
    if given:
        raise ValueError(f"--plan auto chooses the FSDP configuration itself: drop {', '.join(given)}")


def lm_parts(batch_size: int, seq_len: int) -> tuple[Callable[[], Any], Callable[[nn.Module, Any], torch.Tensor]]:
    """(example, loss_fn) of a language model: tokens and targets (batch_size, seq_len) int64,
    the cross-entropy of the logits (batch, seq, vocab) in float32."""
    shape = (batch_size, seq_len)

    def example() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]).float().flatten(0, 1), batch[1].flatten())

    return example, loss_fn


def planned_model(
    cfg: Any,
    device: torch.device,
    make_model: Callable[[], nn.Module],
    is_unit: Callable[[nn.Module], bool],
    param_init_fn: Callable[[nn.Module], None] | None = None,
    *,
    parts: tuple[Callable[[], Any], Callable[[nn.Module, Any], torch.Tensor]] | None = None,
    optimizer: str = "adamw",
) -> nn.Module:
    """Plan (collective: every rank calls it) and return the model wrapped as planned.

    ``make_model`` builds the unwrapped model; ``parts`` is (the example micro-batch, the loss
    of ``(model, batch)``), by default a language model's (tokens (batch_size, seq_len) int64 ->
    logits, cross-entropy); ``optimizer`` is the job's, for the calibration. With
    ``param_init_fn`` the model is built on the meta device and each rank materializes only what
    it holds (FSDP1's ``param_init_fn``, or ``to_empty`` plus ``param_init_fn`` per module after
    ``fully_shard``), else on ``device``. Sets ``cfg.api`` to the front end the plan uses (fsdp1
    for NO_SHARD, fsdp2 otherwise).

    Raises:
        ValueError: on every rank when no configuration fits ``cfg.memory_budget``; the message
            gives the budget the smallest configuration needs.
    """
    from fullshard import distributed
    from fullshard.jobs.train.fsdp_options import PRECISIONS
    from fullshard.planning import calibrate, parse_size, plan

    example, loss_fn = parts if parts is not None else lm_parts(cfg.batch_size, cfg.seq_len)
    dtype = PRECISIONS[cfg.mixed_precision]
    cal = calibrate(make_model, example, loss_fn, is_unit, device, compute_dtype=dtype, optimizer=optimizer)
    group = distributed.default_group()
    answer = None
    if distributed.group_rank(group) == 0:
        result = plan(cal, make_model, example, loss_fn, is_unit, parse_size(cfg.memory_budget), param_dtype=dtype)
        answer = (result.describe(), result.best.candidate if result.best is not None else None)
    lines, chosen = distributed.broadcast_object(answer, 0, group)
    if chosen is None:
        raise ValueError(f"--plan auto --memory-budget {cfg.memory_budget}: {lines[0]}")
    if distributed.group_rank(group) == 0:
        print("--plan auto: " + "\n".join(lines), flush=True)
    cfg.api = "fsdp1" if chosen.no_shard else "fsdp2"
    torch.manual_seed(cfg.seed)  # calibration drew random numbers: the model starts as without a plan
    with torch.device("meta" if param_init_fn is not None else device):
        model = make_model()
    return chosen.apply(model, dtype, param_init_fn=param_init_fn, device=device)
