"""``fullshard estimate``: predicted memory per rank of one FSDP configuration, before any step.

    fullshard estimate --model gpt:124m --batch-size 8 --seq-len 1024 --world-size 8 \\
        --activation-checkpointing --mixed-precision bf16
    fullshard estimate --model mnist --batch-size 64 --world-size 2
    fullshard estimate --model hf:LlamaForCausalLM --batch-size 1 --seq-len 2048 --world-size 8
    fullshard estimate --model mypkg.models:make_model --input-shape 16,3,224,224 \\
        --wrap-cls Bottleneck --world-size 4

Nothing is allocated: the model is built and traced on the meta device (see
:mod:`fullshard.plan.peak`). A ``module:factory`` model is called with no arguments; its
input is a float tensor of ``--input-shape`` and its loss the sum of its output. An ``hf:NAME``
model is one of the HF job's configs or a transformers causal-LM class from its default config
(:func:`fullshard.jobs.train.hf.hf_model`), fed tokens (batch, seq-len), its loss the
cross-entropy of its logits; its units are its decoder layers unless ``--wrap-cls`` says.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

import torch

from fullshard.jobs.train.plan_options import lm_parts
from fullshard.plan.estimate import OPTIMIZER_BUFFERS
from fullshard.plan.peak import PeakEstimate, estimate_peak

PRECISIONS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fullshard estimate", description=__doc__)
    p.add_argument("--model", required=True, help="gpt:PRESET, mnist, hf:NAME, or module.path:factory")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank")
    p.add_argument("--seq-len", type=int, default=128, help="gpt: tokens per sequence")
    p.add_argument("--input-shape", default=None, help="module:factory: the input's shape, e.g. 16,3,224,224")
    p.add_argument(
        "--wrap-cls",
        default=None,
        help="class names that become units, comma-separated (module:factory; hf: default its decoder layers)",
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sharding-strategy", default="full_shard", choices=["full_shard", "shard_grad_op", "no_shard"])
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each unit in backward")
    p.add_argument("--mixed-precision", default="none", choices=sorted(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BUFFERS))
    p.add_argument(
        "--backend",
        default="nccl" if torch.cuda.is_available() else "gloo",
        choices=["gloo", "nccl"],
        help="the process group's (default: nccl when CUDA is available, else gloo)",
    )
    return p


def _model_parts(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(make_model, example, loss_fn, is_unit) for ``--model``; ValueError when it is unusable."""
    if args.model.startswith("gpt:"):
        from fullshard.jobs.models.gpt import GPT, PRESETS, Block

        preset = args.model[4:]
        if preset not in PRESETS:
            raise ValueError(f"--model {args.model}: presets are {', '.join('gpt:' + p for p in PRESETS)}")
        example, loss_fn = lm_parts(args.batch_size, args.seq_len)
        return (lambda: GPT(PRESETS[preset])), example, loss_fn, (lambda m: isinstance(m, Block))
    if args.model.startswith("hf:"):
        from fullshard.jobs.train.hf import hf_model

        make, layers = hf_model(args.model[3:], args.wrap_cls)  # ValueError naming the model's classes
        example, loss_fn = lm_parts(args.batch_size, args.seq_len)
        return make, example, loss_fn, (lambda m: type(m).__name__ in layers)
    if args.model == "mnist":
        from fullshard.jobs.planning.validate import Config, mnist_parts

        return mnist_parts(Config("mnist", args.world_size, batch=args.batch_size))
    module_name, _, factory = args.model.partition(":")
    if not factory or args.input_shape is None or args.wrap_cls is None:
        raise ValueError(
            f"--model {args.model!r}: give gpt:PRESET, mnist, hf:NAME, or module.path:factory with "
            "--input-shape and --wrap-cls"
        )
    make = getattr(importlib.import_module(module_name), factory)
    dims = _shape(args.input_shape)
    names = set(args.wrap_cls.split(","))
    return make, (lambda: torch.zeros(dims)), (lambda m, x: m(x).float().sum()), (lambda m: type(m).__name__ in names)


def checked_model_parts(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """:func:`_model_parts`, a ``module:factory`` model also built and run forward on the meta
    device once (:func:`_check_factory`): for the commands' own process, before any worker starts
    (the workers take :func:`_model_parts` as checked)."""
    parts = _model_parts(args)
    if not args.model.startswith(("gpt:", "hf:")) and args.model != "mnist":
        _check_factory(args, *parts)
    return parts


def _shape(text: str) -> list[int]:
    """``--input-shape``'s dimensions; ValueError naming the option when they are not positive ints."""
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise ValueError(f"--input-shape {text!r}: give positive integers separated by commas, e.g. 16,3,224,224")
    return dims


def _check_factory(args: argparse.Namespace, make: Any, example: Any, loss_fn: Any, is_unit: Any) -> None:
    """A ``module:factory`` model built and run forward on the meta device: ValueError naming
    ``--wrap-cls`` classes the model has no module of (with some it has), or ``--input-shape``
    when the forward fails on it (with the error's last line)."""
    from fullshard.plan.meta_trace import MetaValueRead, traced

    with torch.device("meta"):
        model = make()
        batch = example()
    kinds = list(dict.fromkeys(type(m).__name__ for m in model.modules()))
    missing = sorted(set(args.wrap_cls.split(",")) - set(kinds))
    if missing:
        shown = ", ".join(kinds[:8]) + (", ..." if len(kinds) > 8 else "")
        raise ValueError(
            f"--wrap-cls {','.join(missing)}: no module of {args.model} is of that class; its classes are {shown}"
        )
    try:
        with traced("cpu"):
            loss_fn(model, batch)
    except MetaValueRead:
        pass  # the estimate says so, with what it read
    except Exception as err:  # noqa: BLE001 (the user's model: any error is the shape's)
        lines = str(err).strip().splitlines()
        last = f"{type(err).__name__}: {lines[-1] if lines else ''}"
        raise ValueError(
            f"--input-shape {args.input_shape}: the model's forward failed on a float tensor of that shape "
            f"({last}); give the shape its forward takes"
        ) from None


def table(e: PeakEstimate, world: int) -> list[str]:
    """The estimate as markdown lines (MiB per rank)."""
    rows = [
        ("parameter shards", e.shards),
        ("sharded gradients (gloo: all, kept between steps; nccl: produced by the peak)", e.gradients),
        ("optimizer state", e.optimizer),
        ("gathered full parameters (root, current, prefetched)", e.gathered),
        ("gradient being reduce-scattered (packed input; gloo: receive buffer)", e.gradient_buffer),
        ("activations, saved tensors and temporaries", e.activations),
    ]
    lines = [f"| per rank ({world} ranks) | MiB |", "|---|---|"]
    lines += [f"| {name} | {b / 2**20:,.2f} |" for name, b in rows]
    lines.append(f"| **peak** (in {e.moment}) | **{e.total / 2**20:,.2f}** |")
    if e.host:
        lines.append(f"| host memory (CPU offload: shards, gradients, optimizer state) | {e.host / 2**20:,.2f} |")
    units = sorted(e.units, key=lambda u: u.full_bytes, reverse=True)
    largest = f"the largest ({units[0].name}) gathers {units[0].full_bytes / 2**20:,.2f} MiB"
    lines.append(f"\n{len(e.units)} FSDP units; {largest}")
    if e.bound:
        lines.append(f"Not exact (an upper bound where it could not know): {e.bound}.")
    return lines


def main(argv: Sequence[str]) -> int:
    """Entry point of ``fullshard estimate``; returns the exit code (2 on bad options)."""
    p = _parser()
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="shards, gradients and optimizer state in host memory (nccl; no effect on gloo)",
    )
    args = p.parse_args(list(argv))
    if args.world_size < 1 or args.batch_size < 1:
        p.error("--world-size and --batch-size must be at least 1")
    if args.cpu_offload and args.sharding_strategy == "no_shard" and args.backend == "nccl":
        p.error(
            "--cpu-offload with --sharding-strategy no_shard on nccl is not modeled (no model of what it stages): "
            "drop --cpu-offload, or use full_shard or shard_grad_op"
        )
    if args.cpu_offload and args.backend == "gloo":
        print("fullshard estimate: --cpu-offload has no effect on gloo (the shards already live in CPU memory)")
    try:
        make, example, loss_fn, is_unit = checked_model_parts(args)
    except (ValueError, ImportError, AttributeError) as err:
        p.error(str(err))
    estimate = estimate_peak(
        make,
        example,
        loss_fn,
        is_unit,
        args.world_size,
        param_dtype=PRECISIONS[args.mixed_precision],
        checkpoint=is_unit if args.activation_checkpointing else None,
        optimizer=args.optimizer,
        sharding_strategy=args.sharding_strategy,
        backend=args.backend,
        cpu_offload=args.cpu_offload,
    )
    print("\n".join(table(estimate, args.world_size)))
    return 0
