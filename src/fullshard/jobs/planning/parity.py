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

:func:`draw_extras` adds the options the sweep's generator does not draw (gradient clipping,
forward and backward prefetch, CPU offload), from a generator of their own seeded by the
configuration's seed and index, so a seed's configurations stay what they were without them.
The reference clips with the norm summed in float64 (:func:`_exact_clip`).
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any, NamedTuple

import torch
from torch import nn

from fullshard import compat
from fullshard.jobs import launch
from fullshard.jobs.planning import families, sweep_bench
from fullshard.jobs.planning.sweep import Config, selective_context
from fullshard.jobs.train.global_batch import gradient_sync

_STRATEGY = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD"}
_HYBRID = {"full_shard": "HYBRID_SHARD", "shard_grad_op": "_HYBRID_SHARD_ZERO2"}
OPTIMIZERS = ("adamw", "sgd")


class Extras(NamedTuple):
    """Options set alike on fullshard, torch and (for clipping) the reference."""

    clip: float | None = None  # clip_grad_norm_ to this max norm before each step; None: no clipping
    forward_prefetch: bool = False
    backward_prefetch: str = "pre"  # "pre", "post" (the FSDP1 wrapper only) or "none"
    # Shards in host memory: fullshard warns that a CPU-only run has them there already; torch's
    # fully_shard takes CPUOffloadPolicy(pin_memory=False); torch's FSDP1 refuses it on CPU, so runs without.
    cpu_offload: bool = False
    hybrid: bool = False  # at 4 ranks: a (2, 2) replicate x shard mesh, hybrid sharding on both

    def describe(self) -> str:
        """E.g. ``clip=0.031 fwd-prefetch bwd=post offload``; empty for the defaults."""
        parts = [f"clip={self.clip:.3g}"] if self.clip is not None else []
        parts += ["fwd-prefetch"] if self.forward_prefetch else []
        parts += [f"bwd={self.backward_prefetch}"] if self.backward_prefetch != "pre" else []
        parts += ["offload"] if self.cpu_offload else []
        parts += ["hsdp 2x2"] if self.hybrid else []
        return " ".join(parts)


NO_EXTRAS = Extras()


def draw_extras(c: Config) -> Extras:
    """``c``'s extra options, drawn from ``random.Random`` seeded by ``c.seed`` and ``c.index``
    alone: clipping half the time (a max norm log-uniform in [0.01, 1]), forward prefetch, CPU
    offload half the time each, backward prefetch pre / post / none (``fully_shard``: pre / none),
    and at 4 ranks, unless NO_SHARD, hybrid sharding over a (2, 2) mesh half the time."""
    rng = random.Random(f"parity-extras:{c.seed}:{c.index}")
    max_norm = 10 ** rng.uniform(-2.0, 0.0)
    clip = max_norm if rng.random() < 0.5 else None
    forward, offload = rng.random() < 0.5, rng.random() < 0.5
    backward = rng.choice(("pre", "post", "none") if c.api == "fsdp1" else ("pre", "none"))
    hybrid = rng.random() < 0.5 and c.world == 4 and c.strategy != "no_shard"  # drawn last: earlier draws stay
    return Extras(clip, forward, backward, offload, hybrid)


class Result(NamedTuple):
    """One configuration's comparison, on rank 0."""

    bitwise: bool  # fullshard's losses and parameters are torch's, bit for bit
    update_error: tuple[float, float]  # fullshard's, torch's: |theta - ref| / |ref - theta_0|
    loss_error: tuple[float, float]  # fullshard's, torch's: max over steps |l - ref| / |ref|


def torch_wrap(c: Config, model: nn.Module, is_unit: Any, extras: Extras = NO_EXTRAS, mesh: Any = None) -> nn.Module:
    """``model`` sharded by torch's FSDP as :func:`sweep_bench.wrap` shards it with fullshard:
    the same units, activation checkpointing, mixed precision (bf16 for parameters, reduction
    and buffers), prefetch, (``fully_shard`` only) CPU offload, and hybrid sharding over
    ``mesh`` when one is given."""
    import torch.distributed.fsdp as tf
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    prefetch = {"pre": tf.BackwardPrefetch.BACKWARD_PRE, "post": tf.BackwardPrefetch.BACKWARD_POST}

    if c.ac != "none":
        apply_ac, wrapper = compat.torch_activation_checkpointing()
        kwargs: dict[str, Any] = {"context_fn": selective_context} if c.ac == "selective" else {}
        apply_ac(model, checkpoint_wrapper_fn=lambda m: wrapper(m, **kwargs), check_fn=is_unit)
    bf16 = c.precision == "bf16"
    if c.api == "fsdp1":
        return tf.FullyShardedDataParallel(
            model,
            auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit),
            sharding_strategy=tf.ShardingStrategy[_STRATEGY[c.strategy] if mesh is None else _HYBRID[c.strategy]],
            device_mesh=mesh,
            mixed_precision=tf.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16) if bf16 else None,
            backward_prefetch=prefetch.get(extras.backward_prefetch),
            forward_prefetch=extras.forward_prefetch,
            device_id=torch.device("cpu"),
        )
    kw: dict[str, Any] = {"reshard_after_forward": c.strategy == "full_shard"}
    if bf16:
        kw["mp_policy"] = tf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if extras.cpu_offload:
        kw["offload_policy"] = tf.CPUOffloadPolicy(pin_memory=False)
    if mesh is not None:
        kw["mesh"] = mesh
    units = [m for m in _post_order(model) if m is not model and is_unit(m)]  # inner units first
    for m in units:
        tf.fully_shard(m, **kw)
    tf.fully_shard(model, **kw)
    sharded: list[Any] = [*units, model]
    if extras.forward_prefetch:  # as fsdp_options.shard_model sets it for fullshard
        for unit, following in zip(sharded, sharded[1:-1]):
            unit.set_modules_to_forward_prefetch([following])
    if extras.backward_prefetch == "none":
        for unit in sharded:
            unit.set_modules_to_backward_prefetch([])
    return model


def _post_order(module: nn.Module) -> Any:
    for child in module.children():
        yield from _post_order(child)
    yield module


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
    return families.random_batch(c.family, example, c.shape.vocab, c.shape.classes)


def _clip(model: nn.Module, extras: Extras, fsdp1: bool) -> None:
    """Clip the gradients as the front end's users do: the FSDP1 wrapper's method (torch's or
    fullshard's), else torch's function (on ``fully_shard``'s DTensors, or unsharded)."""
    if extras.clip is None:
        return
    if fsdp1:
        model.clip_grad_norm_(extras.clip)  # type: ignore[operator]
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), extras.clip)


def _exact_clip(model: nn.Module, max_norm: float) -> None:
    """The reference's clipping: torch's rule (scale by ``max_norm / (norm + 1e-6)`` when below 1)
    with the norm summed in float64, so that it is the norm's correctly rounded float32 (torch's
    float32 sums of float32 squares are a few ulps off, which would bias the comparison)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().float()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)


def train_rank(
    c: Config, rank: int, which: str, steps: int, optim: str, accumulate: int = 1, extras: Extras = NO_EXTRAS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """On one rank of a started process group: ``c`` sharded by ``which`` ("fullshard" or
    "torch") with ``extras``, and trained ``steps`` steps of ``accumulate`` micro-batches each
    (gradient sync off for all but the last); rank ``rank``'s losses (the mean over a step's
    micro-batches) and the final parameters."""
    make, example, loss_fn, is_unit = families.parts(c.family, c.shape, c.batch, c.seq)
    mesh = None
    if extras.hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = make()
    if which == "fullshard":
        model = sweep_bench.wrap(
            c,
            model,
            is_unit,
            cpu_offload=extras.cpu_offload,
            forward_prefetch=extras.forward_prefetch,
            backward_prefetch=extras.backward_prefetch,
            mesh=mesh,
        )
    else:
        model = torch_wrap(c, model, is_unit, extras, mesh)
    opt = _optimizer(model.parameters(), optim)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accumulate):
            with gradient_sync(model, enabled=micro == accumulate - 1):
                loss = loss_fn(model, _batch(c, example, step, rank, micro)) / accumulate
                loss.backward()
            total += loss.item()
        _clip(model, extras, c.api == "fsdp1")
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, full_params(model, which if c.api == "fsdp1" else "")


def reference(
    c: Config, steps: int, optim: str, accumulate: int = 1, extras: Extras = NO_EXTRAS
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
        if extras.clip is not None:
            _exact_clip(model, extras.clip)
        opt.step()
        opt.zero_grad()
        losses.append(rank0)
    return losses, initial, {n: p.detach().clone() for n, p in model.named_parameters()}


def compare_rank(
    c: Config, rank: int, steps: int = 3, optim: str = "adamw", accumulate: int = 1, extras: Extras = NO_EXTRAS
) -> Result | None:
    """On each rank of a started process group of ``c.world`` ranks: train fullshard and torch
    with ``extras``; rank 0 then runs the reference and returns the :class:`Result` (the others
    None).

    Raises:
        RuntimeError: fullshard's run failed (saying whether torch's fails too, as when a kernel
            refuses the model's shapes), or the two name the parameters differently.
    """
    try:
        ours, ours_params = train_rank(c, rank, "fullshard", steps, optim, accumulate, extras)
    except Exception as err:  # the model itself may fail (a kernel's limits): torch's run decides
        try:
            train_rank(c, rank, "torch", steps, optim, accumulate, extras)
        except Exception as theirs_too:
            raise RuntimeError(f"fails on torch's FSDP too: {type(theirs_too).__name__}: {theirs_too}") from err
        raise RuntimeError(f"fails on fullshard only: {type(err).__name__}: {err}") from err
    theirs, their_params = train_rank(c, rank, "torch", steps, optim, accumulate, extras)
    if rank != 0:
        return None
    ref, initial, ref_params = reference(c, steps, optim, accumulate, extras)
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


def worker(c: Config, steps: int, optim: str, accumulate: int = 1, extras: Extras = NO_EXTRAS) -> Result | None:
    """:func:`compare_rank` in a process started by :func:`fullshard.jobs.launch.launch`."""
    launch.init_process_group()
    try:
        return compare_rank(c, launch.rank(), steps, optim, accumulate, extras)
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
