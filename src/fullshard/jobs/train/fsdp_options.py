"""The FSDP settings every training job takes on its command line, and their translation."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullshard import BackwardPrefetch, CommQuantization, ShardingStrategy
from fullshard.api import parse_sharding_strategy
from fullshard.wrap import is_unit

APIS = ("fsdp1", "fsdp2")

PRECISIONS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add --sharding-strategy, --mixed-precision, --cpu-offload, prefetch options."""
    p.add_argument(
        "--sharding-strategy", default="full_shard", help="full_shard, shard_grad_op, no_shard, hybrid_shard"
    )
    p.add_argument("--mixed-precision", default="none", help="none, bf16 or fp16 (gather, compute and reduce)")
    p.add_argument("--cpu-offload", action="store_true", help="keep shards and gradients in CPU memory (GPU runs)")
    p.add_argument("--backward-prefetch", default="pre", help="pre, post or none")
    p.add_argument("--forward-prefetch", action="store_true", help="gather the next unit during forward")
    p.add_argument(
        "--comm-quant",
        default="none",
        metavar="SPEC",
        help="quantized communication: none (exact, the default); on (parameters all-gathered as int8 "
        "blocks, gradients reduce-scattered in bf16); int8 (both int8, gradients rounded stochastically); "
        "or key=value pairs such as params=int8,grads=bf16,block_size=256 (params: int8 or none; grads: "
        "bf16, int8 or none). See docs/comm_quantization.md",
    )
    p.add_argument(
        "--api",
        default="fsdp1",
        choices=APIS,
        help="front end: fsdp1 (the FullyShardedDataParallel wrapper) or fsdp2 (fully_shard, DTensor parameters)",
    )


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
    comm_quantization(cfg)
    api = getattr(cfg, "api", "fsdp1")
    if api not in APIS:
        raise ValueError(f"--api {api!r}: use fsdp1 or fsdp2")
    if api == "fsdp2":
        if parse_sharding_strategy(cfg.sharding_strategy) not in (
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.SHARD_GRAD_OP,
        ):
            raise ValueError(
                f"--api fsdp2 --sharding-strategy {cfg.sharding_strategy}: fully_shard takes full_shard or "
                "shard_grad_op (hybrid sharding needs a 2-D device mesh; use --api fsdp1 for no_shard and hybrid_shard)"
            )
        if cfg.backward_prefetch == "post":
            raise ValueError(
                "--api fsdp2 --backward-prefetch post: fully_shard prefetches when a unit's backward "
                "starts (pre) or not at all (none)"
            )


def comm_quantization(cfg: Any) -> CommQuantization | None:
    """The CommQuantization that ``cfg.comm_quant`` names (None for "none" or a config without it).

    Raises:
        ValueError: a spec that is neither a preset nor valid key=value pairs, naming --comm-quant.
    """
    spec = getattr(cfg, "comm_quant", "none")
    if spec.strip().lower() == "none":
        return None
    try:
        return CommQuantization.from_spec(spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--comm-quant {spec!r}: {e}") from None


def fsdp_kwargs(cfg: Any) -> dict[str, Any]:
    """FullyShardedDataParallel keyword arguments from a job config's FSDP fields."""
    return dict(
        sharding_strategy=cfg.sharding_strategy,
        mixed_precision=PRECISIONS[cfg.mixed_precision],
        cpu_offload=cfg.cpu_offload,
        backward_prefetch=PREFETCH[cfg.backward_prefetch],
        forward_prefetch=cfg.forward_prefetch,
        comm_quantization=comm_quantization(cfg),
    )


def shard_model(
    model: nn.Module, cfg: Any, policy: Callable[..., bool], mesh: Any = None, **fsdp1_kwargs: Any
) -> nn.Module:
    """Shard ``model`` with the front end ``cfg.api`` names: the FSDP1 wrapper with
    ``auto_wrap_policy=policy``, or ``fully_shard`` on each module the same policy selects
    (bottom-up), then on the root. ``mesh``: a DeviceMesh to shard over (2-D: replicate x
    shard, with a hybrid ``cfg.sharding_strategy`` for the wrapper), the wrapper's
    ``device_mesh``; None: the whole world. Returns the model to train (the wrapper, or ``model``)."""
    if getattr(cfg, "api", "fsdp1") == "fsdp1":
        from fullshard import FullyShardedDataParallel

        if mesh is not None:
            fsdp1_kwargs["device_mesh"] = mesh
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, **fsdp1_kwargs, **fsdp_kwargs(cfg))
    from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from fullshard.wrap import apply_policy

    kwargs: dict[str, Any] = {
        "reshard_after_forward": parse_sharding_strategy(cfg.sharding_strategy) is ShardingStrategy.FULL_SHARD,
    }
    dtype = PRECISIONS[cfg.mixed_precision]
    if dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    quant = comm_quantization(cfg)
    if quant is not None:
        kwargs["comm_quantization"] = quant
    if mesh is not None:
        kwargs["mesh"] = mesh
    units: list[nn.Module] = []

    def shard(m: nn.Module) -> nn.Module:
        units.append(fully_shard(m, **kwargs))
        return m

    apply_policy(model, policy, shard, is_unit, set())
    # The root keeps its parameters from forward into backward (torch's default, which an
    # explicit reshard_after_forward on the root would turn off: one more all-gather a step).
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    sharded: list[Any] = [*units, model]
    if cfg.forward_prefetch:
        for unit, following in zip(sharded, sharded[1:-1]):
            unit.set_modules_to_forward_prefetch([following])
    if cfg.backward_prefetch == "none":
        for unit in sharded:
            unit.set_modules_to_backward_prefetch([])
    return model


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm: the wrapper's method, or torch's own function on
    fully_shard's DTensor gradients (what FSDP2 programs call). Returns the norm (a scalar)."""
    from fullshard import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict (collective) on rank 0, in CPU memory; ``{}`` on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fullshard import FullyShardedDataParallel, distributed

    if isinstance(model, FullyShardedDataParallel):  # full tensors on every rank
        state = model.state_dict()
        return (
            {k: v.cpu() for k, v in state.items()} if distributed.group_rank(distributed.default_group()) == 0 else {}
        )
    return dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))  # type: ignore[arg-type]


def save_full_model(model: nn.Module, path: str | None) -> None:
    """``--save-model``: gather the full state dict (collective: every rank) and write it to
    ``path`` with torch.save on rank 0 (its missing folders made); nothing when ``path`` is None."""
    from fullshard import distributed

    if path is None:
        return
    state = full_state_dict(model)
    if distributed.group_rank(distributed.default_group()) == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        print(f"saved the full state dict to {path}", flush=True)
