"""Calibration for the step-time model: what collectives and blocks cost on this machine.

- :func:`calibrate_comm` times all-gather, reduce-scatter and all-reduce of a few sizes in the
  process group (every rank at once, the slowest rank's time counts, the fastest of a few
  repeats) and fits
  ``seconds = latency + bytes x seconds_per_byte`` per collective, ``bytes`` being the full
  (gathered, or pre-reduction) tensor's; the process CPU time they take per second is kept too.
- :func:`time_units` times the forward and the backward of each distinct FSDP unit (one module
  of each kind at the input shape a meta-device trace of the real batch gives it, on the real
  device, one kind at a time, run once per unit of that kind) and of the root's own layers (the
  model with every unit replaced by a stand-in that costs nothing), so no more than one block
  is ever materialized with the root; and each unit as activation checkpointing runs it (its
  backward recomputing the forward), in turns with its plain runs.
- :func:`calibrate_copies` fits host-to-device and device-to-host copies of pinned memory
  (CPU offload's uploads of shards and downloads of gradient shards), on CUDA only.
- :func:`time_optimizer` times an optimizer step over a rank's shard.

Each takes seconds, not minutes; the numbers feed :mod:`fullshard.plan.simulate`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives
from fullshard.compat import tree_flatten, tree_map
from fullshard.plan.meta_trace import traced
from fullshard.plan.peak import cast_floats
from fullshard.plan.real_buffers import buffer_values, fill_buffers


@dataclasses.dataclass(frozen=True)
class Link:
    """One collective's fitted cost: ``latency`` seconds plus ``seconds_per_byte`` per byte."""

    latency: float
    seconds_per_byte: float

    def seconds(self, nbytes: int) -> float:
        """Predicted seconds for a collective over a full tensor of ``nbytes`` bytes (0 for none)."""
        return 0.0 if nbytes <= 0 else self.latency + self.seconds_per_byte * nbytes


FREE = Link(0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class CommModel:
    """Fitted costs of the three collectives FSDP issues, for one backend and world size.

    ``cpu_share`` is the CPU seconds this process spends per second of a collective (gloo's
    copies and socket work; about 0.7 measured on loopback). ``contended`` says that the ranks'
    compute threads leave fewer cores free than there are ranks on this machine (a CPU device,
    cores - ranks x intra-op threads < ranks): no collective then runs beside compute for free (see
    :func:`~fullshard.plan.simulate.simulate_step`).
    """

    world_size: int
    backend: str
    all_gather: Link = FREE
    reduce_scatter: Link = FREE
    all_reduce: Link = FREE
    cpu_share: float = 0.0
    contended: bool = False
    h2d: Link = FREE
    d2h: Link = FREE
    """Copies of pinned host memory to and from the device (CPU offload); FREE on a CPU device."""


def _fit(points: list[tuple[int, float]]) -> Link:
    """Least-squares line through (bytes, seconds); both coefficients kept non-negative."""
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((b - mb) ** 2 for b, _ in points)
    slope = max(0.0, sum((b - mb) * (t - mt) for b, t in points) / var) if var else 0.0
    return Link(max(0.0, mt - slope * mb), slope)


def _time_op(run: Callable[[], None], repeats: int, group: Any) -> tuple[float, float]:
    """(least wall seconds, median process CPU seconds) of ``run`` over ``repeats``, each the
    slowest rank's (a collective call). The least wall time: on a shared machine a repeat is
    slower whenever another process holds a core one rank waits for (medians of one collective
    varied several-fold between minutes under other sessions' load); the fastest repeat is the
    collective's own cost, as the block timings (CPU time) are the blocks' own."""
    run()  # warm-up: first use of a size allocates gloo's buffers
    times, cpu = [], []
    for _ in range(repeats):
        collectives.barrier(group)
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    t = torch.tensor([min(times), statistics.median(cpu)], dtype=torch.float64)
    collectives.all_reduce_max(t, group)
    return float(t[0]), float(t[1])


def calibrate_comm(
    group: Any = None, sizes: tuple[int, ...] = (1 << 14, 1 << 18, 1 << 21, 1 << 23), repeats: int = 7
) -> CommModel:
    """Time the three collectives at each full-tensor size in ``sizes`` (bytes, float32) and fit
    each; collective: every rank of ``group`` (default: the world) must call it. A world of one
    rank communicates nothing (all costs 0)."""
    group = group if group is not None else collectives.default_group()
    world = collectives.group_size(group)
    world_local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this machine
    device = collectives.reduction_device(group)
    model = CommModel(world, collectives.backend(group))
    if world == 1:
        return model
    fits: dict[str, list[tuple[int, float]]] = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
    wall = cpu = 0.0
    for size in sizes:
        numel = max(world, size // 4 // world * world)
        full = torch.zeros(numel, device=device)
        shard = torch.zeros(numel // world, device=device)
        ops: dict[str, Callable[[], Any]] = {
            "all_gather": lambda: collectives.all_gather(full, shard, group),
            "reduce_scatter": lambda: collectives.reduce_scatter(shard, full, group),
            "all_reduce": lambda: collectives.all_reduce(full, group),
        }
        for name, op in ops.items():
            seconds, cpu_seconds = _time_op(op, repeats, group)
            fits[name].append((numel * 4, seconds))
            wall, cpu = wall + seconds, cpu + cpu_seconds
    ag, rs, ar = (_fit(fits[name]) for name in ("all_gather", "reduce_scatter", "all_reduce"))
    # each rank's collectives need a core the ranks' compute threads leave free
    spare = (os.cpu_count() or 1) - world_local * torch.get_num_threads()
    contended = device.type == "cpu" and spare < world_local
    return dataclasses.replace(
        model, all_gather=ag, reduce_scatter=rs, all_reduce=ar, cpu_share=cpu / wall, contended=contended
    )


def calibrate_copies(
    device: torch.device, sizes: tuple[int, ...] = (1 << 20, 1 << 23, 1 << 26), repeats: int = 5
) -> tuple[Link, Link]:
    """(host-to-device, device-to-host) copy costs of pinned memory, each fitted over ``sizes``
    bytes on this rank: what CPU offload adds to every gather and reduce-scatter. On a CPU
    device, where offload moves nothing, both are free."""
    if device.type != "cuda":
        return FREE, FREE
    fits: dict[str, list[tuple[int, float]]] = {"h2d": [], "d2h": []}
    for size in sizes:
        host = torch.empty(size // 4, pin_memory=True)
        dev = torch.empty(size // 4, device=device)
        runs = {"h2d": lambda: dev.copy_(host, non_blocking=True), "d2h": lambda: host.copy_(dev, non_blocking=True)}
        for name, run in runs.items():
            times = []
            for i in range(repeats + 1):  # the first is a warm-up
                _sync(device)
                start = time.perf_counter()
                run()
                _sync(device)
                if i:
                    times.append(time.perf_counter() - start)
            fits[name].append((size, statistics.median(times)))
    return _fit(fits["h2d"]), _fit(fits["d2h"])


@dataclasses.dataclass(frozen=True)
class BlockTime:
    """Seconds of one forward and of one backward (without recomputation) of a module."""

    forward: float
    backward: float


def hidden_states(output: Any) -> torch.Tensor | None:
    """A unit's output tensor that the rest of the model computes from: ``output`` itself, or the
    first floating-point tensor of a tuple, list or dict (a decoder layer's hidden states before
    its attention weights or cache, as transformers' Falcon layer returns them); None if none."""
    leaves, _ = tree_flatten(output)
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _hidden(output: Any) -> torch.Tensor:
    main = hidden_states(output)
    assert main is not None, "a timed unit's output holds a floating-point tensor (checked by _kind)"
    return main


class _Stub(nn.Module):
    """Stands in for a unit when the root's own layers are timed: returns fresh zero tensors in
    the structure of the unit's output (``like``: what the meta trace saw; anything not a tensor
    as it was), the hidden states passing a zero gradient back to the unit's first input."""

    def __init__(self, like: Any) -> None:
        super().__init__()
        self.like = like

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        main = hidden_states(self.like)

        def fresh(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            out = torch.zeros(t.shape, dtype=t.dtype, device=x.device)
            return out + x.flatten()[0] * 0 if t is main and x.requires_grad else out

        return tree_map(fresh, self.like)


def _units(model: nn.Module, is_unit: Callable[[nn.Module], bool]) -> dict[str, nn.Module]:
    """The outermost unit modules by name (a unit nested in another is timed with its parent)."""
    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if name and is_unit(m) and not any(name.startswith(o + ".") for o in out):
            out[name] = m
    return out


def _like(t: Any, device: torch.device) -> Any:
    """A real tensor for a meta one: random floats (needing a gradient where the traced one did:
    a block's hidden states, not its rotary tables), zeros otherwise."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype, device=device).requires_grad_(t.requires_grad)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _materialize(
    module: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor] | None, prefix: str = ""
) -> nn.Module:
    """``module`` (the model's submodule ``prefix``, on meta) on ``device``: random parameters,
    its buffers' values from ``buffers`` (:func:`~fullshard.plan.real_buffers.buffer_values`)."""
    module = module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    fill_buffers(module, buffers, prefix)
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_clock(device: torch.device) -> Callable[[], float]:
    """The clock that times compute on ``device``: on a CPU computing on one thread (each rank's
    share of the cores, as ``launch`` sets it on this project's 2-core machine), the calling
    thread's CPU time, which other processes' work on a shared machine does not change (measured
    under a load average of 9 on 2 cores: a block's wall times varied 1.4-2.2x between runs,
    its CPU times 0.9-1.1x); on a GPU, or on several CPU threads, wall time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _time_fb(forward: Callable[[], Any], device: torch.device, repeats: int, copies: int = 1) -> BlockTime:
    """Median seconds of one forward and one backward of ``forward()`` (see :func:`_time_each`)."""
    return _time_each([(forward, copies)], device, repeats)[0]


def _time_each(runs: list[tuple[Callable[[], Any], int]], device: torch.device, repeats: int) -> list[BlockTime]:
    """Median seconds of one forward and one backward of each ``(forward, copies)`` in ``runs``,
    the runs taking turns within every repeat (so that a slow moment of a shared machine falls
    on all of them, not on one). Each run's ``forward()`` is called ``copies`` times per repeat
    with every output's graph alive until one backward through all of them (the saved
    activations of ``copies`` units at once, as in the model: on CPU their fresh pages cost time
    that one block's, reused from the last repeat, would not); the times are per copy, by
    :func:`compute_clock`."""
    clock = compute_clock(device)
    fwd: list[list[float]] = [[] for _ in runs]
    bwd: list[list[float]] = [[] for _ in runs]
    grads: list[torch.Tensor | None] = [None for _ in runs]  # each output's gradient, made once untimed
    for i in range(repeats + 2):  # the first two are warm-ups (allocations, kernel selection)
        for j, (forward, copies) in enumerate(runs):
            _sync(device)
            t0 = clock()
            outs = [_hidden(forward()) for _ in range(copies)]
            _sync(device)
            if grads[j] is None and outs[0].dim() > 0:
                grads[j] = torch.randn_like(outs[0])
                _sync(device)
            t1 = clock()
            if outs[0].requires_grad:  # else nothing to differentiate (a root with no parameters)
                grad = grads[j]
                torch.autograd.backward(outs, None if grad is None else [grad] * copies)
            _sync(device)
            del outs
            if i >= 2:
                fwd[j].append((t1 - t0) / copies)
                bwd[j].append((clock() - t1) / copies)
    return [BlockTime(statistics.median(f), statistics.median(b)) for f, b in zip(fwd, bwd)]


def _kind(name: str, m: nn.Module, args: tuple, kwargs: dict[str, Any], result: Any) -> tuple:
    """What makes two units time alike: class, parameter shapes and dtypes, input shapes."""
    if hidden_states(result) is None:
        raise TypeError(
            f"unit {name!r} returns {type(result).__name__} with no floating-point tensor; time_units needs its "
            "hidden states: a tensor, or a tuple, list or dict holding it first"
        )
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())
    # a block fed the raw input (no gradient) computes less backward than one fed activations
    inputs = tree_map(lambda a: (tuple(a.shape), a.requires_grad) if isinstance(a, torch.Tensor) else a, (args, kwargs))
    return (type(m).__qualname__, shapes, repr(inputs))


@dataclasses.dataclass(frozen=True)
class UnitTimes:
    """What :func:`time_units` measured: ``blocks``, each unit's (and ``"<root>"``'s) forward and
    backward as they run unwrapped; ``checkpointed``, each unit's as activation checkpointing
    runs it (the forward keeping only its inputs, the backward recomputing the forward first:
    its time includes the recomputation). Seconds, by unit name."""

    blocks: dict[str, BlockTime]
    checkpointed: dict[str, BlockTime]


def time_blocks(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    device: torch.device,
    compute_dtype: torch.dtype | None = None,
    repeats: int = 5,
) -> dict[str, BlockTime]:
    """:func:`time_units`' ``blocks`` alone (no unit timed under activation checkpointing)."""
    return time_units(make_model, example, loss_fn, is_unit, device, compute_dtype, repeats, checkpointed=False).blocks


def time_units(
    make_model: Callable[[], nn.Module],
    example: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    is_unit: Callable[[nn.Module], bool],
    device: torch.device,
    compute_dtype: torch.dtype | None = None,
    repeats: int = 5,
    *,
    checkpointed: bool = True,
) -> UnitTimes:
    """Forward and backward seconds per outermost unit (by name) and of ``"<root>"``'s own layers
    (with the loss), at the batch ``example()`` builds, timed on ``device``; with
    ``checkpointed``, each unit also as activation checkpointing runs it (in the frontend's
    :class:`~fullshard.frontend.activation_checkpointing.CheckpointWrapper`, as a plan applies
    it), taking turns with its plain runs.

    Units of one kind (same class, parameter and input shapes) are timed once. Unwrapped, one
    module runs as many times per forward as the model has units of that kind, its outputs
    holding as much activation memory as the model's; checkpointed, once (one unit's
    activations are alive at a time, in its recomputation). A unit's first argument must be a
    tensor and its output hold one (:func:`hidden_states`: its backward starts there); its other
    arguments, positional or keyword (a transformers decoder
    layer's rotary tables and mask), are replayed as the trace saw them: tensors of their
    shapes, anything else as it was.

    Raises:
        TypeError: a unit's output is not a tensor.
        MetaValueRead: the model reads a tensor value in forward (see
            :func:`~fullshard.plan.meta_trace.traced`).
    """
    with torch.device("meta"):
        model = make_model()
        if compute_dtype is not None:
            model.to(compute_dtype)
        batch = cast_floats(example(), compute_dtype)
    units = _units(model, is_unit)
    buffers = buffer_values(make_model) if any(True for _ in model.buffers()) else None
    seen = _unit_calls(model, batch, loss_fn, units, device)
    out: dict[str, BlockTime] = {}
    recomputed: dict[str, BlockTime] = {}
    kinds: dict[tuple, tuple[BlockTime, BlockTime | None]] = {}
    kind_of = {name: _kind(name, m, *seen[name]) for name, m in units.items()}
    count = collections.Counter(kind_of.values())
    for name, m in units.items():
        kind = kind_of[name]
        if kind not in kinds:
            kinds[kind] = _time_unit(m, seen[name][:2], device, repeats, count[kind], checkpointed, (buffers, name))
        out[name], ckpt = kinds[kind]
        if ckpt is not None:
            recomputed[name] = ckpt
    for name, m in units.items():
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, _Stub(seen[name][2]))
    root = _materialize(model, device, buffers)
    with torch.device(device):
        real_batch = cast_floats(
            tree_map(lambda t: t.zero_() if isinstance(t, torch.Tensor) else t, example()), compute_dtype
        )
    out["<root>"] = _time_fb(lambda: loss_fn(root, real_batch), device, repeats)
    return UnitTimes(out, recomputed)


def _unit_calls(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    units: dict[str, nn.Module],
    device: torch.device,
) -> dict[str, tuple[tuple, dict[str, Any], Any]]:
    """Unit name -> (args, kwargs, output) of its first call in a meta-device forward of the loss."""
    seen: dict[str, tuple[tuple, dict[str, Any], Any]] = {}

    def keep(name: str, args: tuple, kwargs: dict[str, Any], output: Any) -> None:  # None: output as it is
        seen.setdefault(name, (args, kwargs, output))

    hooks = [
        m.register_forward_hook(lambda m, a, k, o, n=name: keep(n, a, k, o), with_kwargs=True)
        for name, m in units.items()
    ]
    try:
        with traced(device.type):
            loss_fn(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _time_unit(
    m: nn.Module,
    inputs: tuple[tuple, dict[str, Any]],
    device: torch.device,
    repeats: int,
    copies: int,
    checkpointed: bool,
    buffers: tuple[dict[str, torch.Tensor] | None, str],
) -> tuple[BlockTime, BlockTime | None]:
    """:func:`_time_each` of a materialized copy of unit ``m`` on (args, kwargs) shaped like
    ``inputs``, ``copies`` at once, and (``checkpointed``) of it under activation checkpointing,
    once, in turns; when ``copies`` outputs at once do not fit the device (CUDA out of memory),
    one at a time; ``buffers``: the model's buffer values and ``m``'s name in it. Returns
    (plain, checkpointed or None)."""
    from fullshard.frontend.activation_checkpointing import checkpoint_wrapper

    real = _materialize(copy.deepcopy(m), device, *buffers)
    args, kwargs = tree_map(lambda t: _like(t, device), inputs)
    wrapped = checkpoint_wrapper(real) if checkpointed else None
    while True:
        runs = [(lambda: real(*args, **kwargs), copies)]
        if wrapped is not None:
            runs.append((lambda: wrapped(*args, **kwargs), 1))
        try:
            times = _time_each(runs, device, repeats)
            return times[0], (times[1] if wrapped is not None else None)
        except torch.OutOfMemoryError:
            if copies == 1:
                raise
            torch.cuda.empty_cache()
            copies = 1


def make_optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer named ``name`` ("adamw" or "adam": fused AdamW, "adadelta", else SGD) over ``params``."""
    if name in ("adamw", "adam"):
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr=1.0)
    return torch.optim.SGD(params, lr=1e-3)


def time_optimizer(numel: int, device: torch.device, optimizer: str = "adamw", repeats: int = 3) -> float:
    """Seconds of one ``optimizer`` step over ``numel`` float32 parameters (a rank's shard)."""
    p = nn.Parameter(torch.zeros(max(1, numel), device=device))
    p.grad = torch.randn_like(p)
    opt = make_optimizer(optimizer, [p])
    clock, times = compute_clock(device), []
    for i in range(repeats + 1):
        _sync(device)
        t0 = clock()
        opt.step()
        _sync(device)
        if i:
            times.append(clock() - t0)
    return statistics.median(times)
