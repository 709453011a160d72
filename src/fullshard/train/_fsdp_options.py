"""The FSDP settings every training job takes on its command line, and their translation."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from fullshard.api import BackwardPrefetch, parse_sharding_strategy

PRECISIONS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add --sharding-strategy, --mixed-precision, --cpu-offload, prefetch options."""
    p.add_argument("--sharding-strategy", default="full_shard", help="full_shard, shard_grad_op, no_shard, hybrid_shard")
    p.add_argument("--mixed-precision", default="none", help="none, bf16 or fp16 (gather, compute and reduce)")
    p.add_argument("--cpu-offload", action="store_true", help="keep shards and gradients in CPU memory (GPU runs)")
    p.add_argument("--backward-prefetch", default="pre", help="pre, post or none")
    p.add_argument("--forward-prefetch", action="store_true", help="gather the next unit during forward")


def validate(cfg: Any) -> None:
    """Check the FSDP fields of a job config.

    Raises:
        ValueError: an unknown strategy, precision or prefetch name, naming the option.
    """
    parse_sharding_strategy(cfg.sharding_strategy)
    if cfg.mixed_precision not in PRECISIONS:
        raise ValueError(f"--mixed-precision {cfg.mixed_precision!r}: use one of {', '.join(PRECISIONS)}")
    if cfg.backward_prefetch not in PREFETCH:
        raise ValueError(f"--backward-prefetch {cfg.backward_prefetch!r}: use one of {', '.join(PREFETCH)}")


def fsdp_kwargs(cfg: Any) -> dict[str, Any]:
    """FullyShardedDataParallel keyword arguments from a job config's FSDP fields."""
    return dict(
        sharding_strategy=cfg.sharding_strategy,
        mixed_precision=PRECISIONS[cfg.mixed_precision],
        cpu_offload=cfg.cpu_offload,
        backward_prefetch=PREFETCH[cfg.backward_prefetch],
        forward_prefetch=cfg.forward_prefetch,
    )
