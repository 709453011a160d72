"""fullshard against torch's own FSDP on the sweep's drawn configurations.

A configuration (:class:`~fullshard.jobs.planning.sweep.Config`: model family and shape,
strategy, activation checkpointing, precision, world size, front end) is built twice from one
seed in one process group: sharded by fullshard as the training jobs shard it
(:func:`~fullshard.jobs.planning.sweep_bench.wrap`), and by torch with the same units and
settings (:func:`torch_wrap`: ``fully_shard`` for ``fsdp2``; ``FullyShardedDataParallel`` with
``device_id=torch.device("cpu")`` for ``fsdp1``, which is how torch's FSDP1 runs on CPU). Both
train the same steps on the same batches (AdamW, or SGD with momentum, which is exact about a
gradient's scale where AdamW turns the rounding noise of a near-zero gradient, such as a key
projection's bias, into lr-sized steps). A third run, in one process, unsharded and in fp32, is
the reference: its loss is the mean of the ranks' (what data parallelism's averaged gradient
descends).

:func:`compare_rank` gives whether fullshard's losses and parameters are torch's bit for bit
and, for each of the two, the update error ``|theta - theta_ref| / |theta_ref - theta_0|`` (all
parameters as one vector) and the largest relative error of rank 0's losses. ``tools/
parity_sweep.py`` runs it over a seed's draws.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
from torch import nn

from fullshard import compat
from fullshard.jobs import launch
from fullshard.jobs.planning import families, sweep_bench
from fullshard.jobs.planning.sweep import Config, selective_context
from fullshard.jobs.train.global_batch import gradient_sync

_STRATEGY = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD"}
OPTIMIZERS = ("adamw", "sgd")


class Result(NamedTuple):
    """One configuration's comparison, on rank 0."""

    bitwise: bool  # fullshard's losses and parameters are torch's, bit for bit
    update_error: tuple[float, float]  # fullshard's, torch's: |theta - ref| / |ref - theta_0|
    loss_error: tuple[float, float]  # fullshard's, torch's: max over steps |l - ref| / |ref|


def torch_wrap(c: Config, model: nn.Module, is_unit: Any) -> nn.Module:
    """``model`` sharded by torch's FSDP as :func:`sweep_bench.wrap` shards it with fullshard:
    the same units, activation checkpointing, mixed precision (bf16 for parameters, reduction
    and buffers) and backward prefetch."""
    import torch.distributed.fsdp as tf
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    if c.ac != "none":
        apply_ac, wrapper = compat.torch_activation_checkpointing()
        kwargs: dict[str, Any] = {"context_fn": selective_context} if c.ac == "selective" else {}
        apply_ac(model, checkpoint_wrapper_fn=lambda m: wrapper(m, **kwargs), check_fn=is_unit)
    bf16 = c.precision == "bf16"
    if c.api == "fsdp1":
        return tf.FullyShardedDataParallel(
            model,
            auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit),
            sharding_strategy=tf.ShardingStrategy[_STRATEGY[c.strategy]],
            mixed_precision=tf.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16) if bf16 else None,
            backward_prefetch=tf.BackwardPrefetch.BACKWARD_PRE,
            device_id=torch.device("cpu"),
        )
    kw: dict[str, Any] = {"reshard_after_forward": c.strategy == "full_shard"}
    if bf16:
        kw["mp_policy"] = tf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for m in [m for m in model.modules() if m is not model and is_unit(m)][::-1]:  # inner units first
        tf.fully_shard(m, **kw)
    tf.fully_shard(model, **kw)
    return model


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def full_params(model: nn.Module, fsdp1: str) -> dict[str, torch.Tensor]:
    """Every parameter whole, in fp32, by its name without wrapper prefixes (collective).
    ``fsdp1``: "torch" or "fullshard" for a wrapper of that FSDP1, "" for ``fully_shard``."""
    if fsdp1:
        if fsdp1 == "torch":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        else:
            from fullshard import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        with FSDP.summon_full_params(model, writeback=False):
            return {_clean(n): p.detach().float().clone() for n, p in model.named_parameters()}
    return {_clean(n): p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]


def _optimizer(params: Any, optim: str) -> torch.optim.Optimizer:
    if optim == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _batch(c: Config, example: Any, step: int, rank: int, micro: int = 0) -> Any:
    torch.manual_seed(1000 * step + 100 * micro + rank)  # each rank its own batch, the same for every run
    return families.random_batch(c.family, example, c.shape.vocab)


def train_rank(
    c: Config, rank: int, which: str, steps: int, optim: str, accumulate: int = 1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """On one rank of a started process group: ``c`` sharded by ``which`` ("fullshard" or
    "torch") and trained ``steps`` steps of ``accumulate`` micro-batches each (gradient sync off
    for all but the last); rank ``rank``'s losses (the mean over a step's micro-batches) and the
    final parameters."""
    make, example, loss_fn, is_unit = families.parts(c.family, c.shape, c.batch, c.seq)
    torch.manual_seed(0)
    model = make()
    model = sweep_bench.wrap(c, model, is_unit) if which == "fullshard" else torch_wrap(c, model, is_unit)
    opt = _optimizer(model.parameters(), optim)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accumulate):
            with gradient_sync(model, enabled=micro == accumulate - 1):
                loss = loss_fn(model, _batch(c, example, step, rank, micro)) / accumulate
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, full_params(model, which if c.api == "fsdp1" else "")


def reference(
    c: Config, steps: int, optim: str, accumulate: int = 1
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, fp32, unsharded: each step descends the mean of the ranks' and micro-batches'
    losses. Returns rank 0's losses, the initial and the final parameters."""
    make, example, loss_fn, _ = families.parts(c.family, c.shape, c.batch, c.seq)
    torch.manual_seed(0)
    model = make()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _optimizer(model.parameters(), optim)
    losses = []
    for step in range(steps):
        rank0 = 0.0
        for micro in range(accumulate):
            per_rank = [loss_fn(model, _batch(c, example, step, r, micro)) / accumulate for r in range(c.world)]
            (sum(per_rank) / c.world).backward()
            rank0 += per_rank[0].item()
        opt.step()
        opt.zero_grad()
        losses.append(rank0)
    return losses, initial, {n: p.detach().clone() for n, p in model.named_parameters()}


def compare_rank(c: Config, rank: int, steps: int = 3, optim: str = "adamw", accumulate: int = 1) -> Result | None:
    """On each rank of a started process group of ``c.world`` ranks: train fullshard and torch;
    rank 0 then runs the reference and returns the :class:`Result` (the others None).

    Raises:
        RuntimeError: fullshard's run failed (saying whether torch's fails too, as when a kernel
            refuses the model's shapes), or the two name the parameters differently.
    """
    try:
        ours, ours_params = train_rank(c, rank, "fullshard", steps, optim, accumulate)
    except Exception as err:  # the model itself may fail (a kernel's limits): torch's run decides
        try:
            train_rank(c, rank, "torch", steps, optim, accumulate)
        except Exception as theirs_too:
            raise RuntimeError(f"fails on torch's FSDP too: {type(theirs_too).__name__}: {theirs_too}") from err
        raise RuntimeError(f"fails on fullshard only: {type(err).__name__}: {err}") from err
    theirs, their_params = train_rank(c, rank, "torch", steps, optim, accumulate)
    if rank != 0:
        return None
    ref, initial, ref_params = reference(c, steps, optim, accumulate)
    if not set(ours_params) == set(their_params) == set(ref_params):
        raise RuntimeError(f"parameter names differ: {sorted(set(ours_params) ^ set(their_params))[:4]}")
    bitwise = ours == theirs and all(torch.equal(ours_params[n], their_params[n]) for n in ref_params)

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float((a[n] - b[n]).double().pow(2).sum()) for n in ref_params))

    moved = max(distance(ref_params, initial), 1e-30)

    def loss_error(losses: list[float]) -> float:
        return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))

    return Result(
        bitwise,
        (distance(ours_params, ref_params) / moved, distance(their_params, ref_params) / moved),
        (loss_error(ours), loss_error(theirs)),
    )


def worker(c: Config, steps: int, optim: str, accumulate: int = 1) -> Result | None:
    """:func:`compare_rank` in a process started by :func:`fullshard.jobs.launch.launch`."""
    launch.init_process_group()
    try:
        return compare_rank(c, launch.rank(), steps, optim, accumulate)
    finally:
        launch.destroy_process_group()


def summary(results: list[Result]) -> list[str]:
    """How often fullshard is torch's bit for bit, and where not, how its update error against
    the reference compares with torch's."""
    differ = [r for r in results if not r.bitwise]
    lines = [f"Bitwise torch's: {len(results) - len(differ)} of {len(results)}."]
    if differ:
        ratios = sorted(r.update_error[0] / max(r.update_error[1], 1e-30) for r in differ)
        worse = sum(x > 1.5 for x in ratios)
        lines.append(
            f"Where not: fullshard's update error / torch's, median {ratios[len(ratios) // 2]:.2f}, "
            f"range {ratios[0]:.2f}-{ratios[-1]:.2f}; above 1.5x in {worse} of {len(differ)}."
        )
    return lines
