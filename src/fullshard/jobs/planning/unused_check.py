"""Run one drawn case of :mod:`fullshard.jobs.planning.unused` on every rank and check it.

:func:`check_rank` builds the case's model twice from one seed: sharded with ``fully_shard`` as
the case says (a split case's two towers each its own root: ``dec(enc(x))``), and unsharded
(the reference, which every rank runs on its own inputs; in bf16 mixed precision, on a
bfloat16 copy whose gradients are taken in float32). After each step's backward (the last
micro-batch's) it checks, on every rank:

- every parameter's ``.grad`` is None or set alike on every rank, and set exactly where the
  unit is flagged, or some rank's reference got a gradient this step, or the ``.grad`` was set
  before the step (no ``zero_grad`` between steps);
- each ``.grad`` (``full_tensor()``) is the reference's gradients all-reduced and averaged over
  the ranks (plus what accumulated before the step), relative to the largest of them;
- the post-accumulate-grad hooks ran as often on every rank, parameter by parameter;
- torch's ``clip_grad_norm_`` gives one norm on every rank, the reference's given the averaged
  gradients, and the optimizer step (SGD with momentum or AdamW) leaves the reference's
  parameters, stepped with those gradients (relative to the largest parameter);
- every unit is idle.

A ``.grad`` None on some ranks only stops the case there (``clip_grad_norm_`` would hang).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fullshard
from fullshard.comm import collectives
from fullshard.engine.hooks import fsdp_state
from fullshard.engine.unit_config import TrainingState
from fullshard.jobs import launch
from fullshard.jobs.planning.unused import STEPS, Case
from fullshard.jobs.planning.unused_model import build, set_step

GRAD_TOL = {False: 1e-5, True: 2e-2}  # relative, by mixed precision: fp32 sums in another order; bf16 rounds
PARAM_TOL = {"sgd": 1e-5, "adamw": 1e-4}  # relative to the largest parameter; bf16: 1e-2
Grads = dict[str, torch.Tensor | None]


@dataclasses.dataclass
class Result:
    """One case's outcome (the worst over ranks): ``failures`` (empty when it passed, at most
    a few lines), the largest relative gradient, norm and parameter errors."""

    failures: list[str]
    grad_error: float = 0.0
    norm_error: float = 0.0
    param_error: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclasses.dataclass
class _Run:
    """One rank's models and what it tracks between steps."""

    case: Case
    rank: int
    ref: nn.Module
    mod: nn.Module
    units: list[nn.Module]
    roots: list[nn.Module]  # one, or a split case's two
    flagged: dict[str, bool]  # per parameter name: its unit is flagged
    ref_optim: torch.optim.Optimizer
    optim: torch.optim.Optimizer
    hooks: dict[str, int]
    accumulated: Grads  # the averaged (clipped) gradients before this step; None: no .grad
    result: Result


def _optimizer(case: Case, params: Any) -> torch.optim.Optimizer:
    if case.optim == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _shard(case: Case, mod: nn.Module) -> tuple[list[nn.Module], list[nn.Module], dict[str, bool]]:
    """Wrap ``mod``'s units as the case says (a split case's two towers each its own root, the
    top-level module not wrapped); returns them (the roots last), the roots and, per parameter,
    whether its unit is flagged. A root that owns a block in a reentrant checkpoint reshards after
    backward as by default: its gradient from the block's nested backward waits for the rest of
    its own (engine.nested_grad). Until 2026-11-29 it had to keep its full parameters through
    backward (``set_reshard_after_backward(False)``): resharded in the nested backward, it failed
    where a block it owns ran before the checkpointed one (seed 730001 case 6) or a second
    checkpointed block recomputed on its shards (seed 20261129 case 36)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if case.hsdp else None
    policy = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": policy if case.mixed else fullshard.MixedPrecisionPolicy()}
    named: list[tuple[str, nn.Module, bool]] = []
    for i, b in enumerate(case.blocks):
        for name, flagged, kept in zip(case.unit_names(i), b.flagged, b.kept):
            module = mod.get_submodule(name)
            fullshard.fully_shard(module, reshard_after_forward=not kept, **kw)
            named.append((name, module, flagged))
    roots = [("enc", case.root_flagged), ("dec", case.root2_flagged)] if case.split else [("", case.root_flagged)]
    for name, flagged in roots:
        module = mod.get_submodule(name)
        fullshard.fully_shard(module, **kw)
        named.append((name, module, flagged))
    for _, module, flagged in named:
        if flagged:
            module.set_reduce_scatter_unused_params(True, recurse=False)  # type: ignore[operator]
        if case.prefetch_off:
            module.set_modules_to_backward_prefetch([])  # type: ignore[operator]
    owner = {}
    for pname, _ in mod.named_parameters():
        best = max((n for n, _, _ in named if n == "" or pname.startswith(n + ".")), key=len)
        owner[pname] = next(f for n, _, f in named if n == best)
    return [m for _, m, _ in named], [m for _, m, _ in named[-len(roots) :]], owner


def _build(case: Case, rank: int) -> _Run:
    torch.manual_seed(case.seed * 1000 + case.index)
    ref = build(case)
    if case.mixed:  # bfloat16's values: the sharded model's cast to bf16 is exact
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.bfloat16().float())
    mod = copy.deepcopy(ref)
    units, roots, flagged = _shard(case, mod)
    hooks = {n: 0 for n, _ in mod.named_parameters()}
    for n, p in mod.named_parameters():

        def count(_: torch.Tensor, n: str = n) -> None:
            hooks[n] += 1

        if p.requires_grad:  # a frozen block's do not
            p.register_post_accumulate_grad_hook(count)
    return _Run(
        case, rank, ref, mod, units, roots, flagged, _optimizer(case, ref.parameters()),
        _optimizer(case, mod.parameters()), hooks, {n: None for n in hooks}, Result([]),
    )  # fmt: skip


def _inputs(case: Case, step: int, micro: int, rank: int) -> torch.Tensor:
    seed = ((case.seed * 1000 + case.index) * 10 + step) * 10 + micro
    x = torch.randn(case.batch, case.hidden, generator=torch.Generator().manual_seed(seed * 10 + rank))
    return (x.bfloat16().float() if case.mixed else x).requires_grad_(case.input_grad)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _reference_grads(run: _Run, x: torch.Tensor) -> Grads:
    """This rank's reference gradients for one micro-batch, in float32 (None: no gradient)."""
    model = copy.deepcopy(run.ref).to(torch.bfloat16) if run.case.mixed else run.ref
    model.zero_grad(set_to_none=True)
    _loss(model(x.to(torch.bfloat16) if run.case.mixed else x)).backward()
    grads = {n: None if p.grad is None else p.grad.float().clone() for n, p in model.named_parameters()}
    run.ref.zero_grad(set_to_none=True)
    return grads


def _average(run: _Run, local: Grads) -> Grads:
    """The step's expected gradients: ``local`` summed over ranks and divided by the world
    size, added to what accumulated before; None where no rank got one, the unit is not
    flagged and nothing accumulated."""
    group, world = collectives.default_group(), run.case.world
    names = list(local)
    used = torch.tensor([float(local[n] is not None) for n in names])
    collectives.all_reduce_max(used, group)
    params = dict(run.ref.named_parameters())
    want: Grads = {}
    for i, n in enumerate(names):
        g = local[n]
        total = g.clone() if g is not None else torch.zeros_like(params[n])
        collectives.all_reduce(total, group, divide_by=world)
        before = run.accumulated[n]
        if used[i] or run.flagged[n] or before is not None:
            want[n] = total if before is None else before + total
        else:
            want[n] = None
    return want


def _note(run: _Run, line: str) -> None:
    if len(run.result.failures) < 6:
        run.result.failures.append(f"rank {run.rank}: {line}")


def _check_grads(run: _Run, step: int, want: Grads) -> bool:
    """The ``.grad`` pattern, values and hook counts; False when the pattern differs between
    ranks (then every rank stops)."""
    group = collectives.default_group()
    has = {n: p.grad is not None for n, p in run.mod.named_parameters()}
    every = collectives.all_gather_object((has, dict(run.hooks)), group)
    if any(e[0] != has for e in every):
        diff = sorted(n for n in has if any(e[0][n] != has[n] for e in every))
        _note(run, f"step {step}: .grad None on some ranks only: {diff}")
        return False
    if any(e[1] != run.hooks for e in every):
        _note(run, f"step {step}: post-accumulate-grad hook counts differ: {[e[1] for e in every]}")
    wrong = sorted(n for n in has if has[n] != (want[n] is not None))
    if wrong:
        _note(run, f"step {step}: .grad {'set' if has[wrong[0]] else 'None'} where expected otherwise: {wrong}")
    scale = max((float(w.abs().max()) for w in want.values() if w is not None and w.numel()), default=0.0)
    for n, p in run.mod.named_parameters():
        w = want[n]
        if p.grad is None or w is None:
            continue
        got = p.grad.full_tensor().float()  # type: ignore[attr-defined]
        err = float((got - w).abs().max()) / max(scale, 1e-12)
        run.result.grad_error = max(run.result.grad_error, err)
        if err > GRAD_TOL[run.case.mixed]:
            _note(run, f"step {step}: {n} gradient off by {err:.1e} (relative)")
    return True


def _step_both(run: _Run, step: int, want: Grads) -> None:
    """Clip and step the sharded model and the reference given ``want``; compare."""
    group = collectives.default_group()
    for n, p in run.ref.named_parameters():
        p.grad = None if want[n] is None else want[n].clone()  # type: ignore[union-attr]
    got = torch.nn.utils.clip_grad_norm_(list(run.mod.parameters()), run.case.clip)
    norm = float((got.full_tensor() if hasattr(got, "full_tensor") else got).detach())
    ref_norm = float(torch.nn.utils.clip_grad_norm_(list(run.ref.parameters()), run.case.clip))
    err = abs(norm - ref_norm) / max(ref_norm, 1e-12)
    run.result.norm_error = max(run.result.norm_error, err)
    if err > GRAD_TOL[run.case.mixed]:
        _note(run, f"step {step}: clip_grad_norm_ {norm:.6g}, reference {ref_norm:.6g}")
    if len(set(collectives.all_gather_object(norm, group))) != 1:
        _note(run, f"step {step}: clip_grad_norm_ differs between ranks")
    run.optim.step()
    run.ref_optim.step()
    scale = max(float(p.abs().max()) for p in run.ref.parameters())
    tol = 1e-2 if run.case.mixed else PARAM_TOL[run.case.optim]
    params = dict(run.ref.named_parameters())
    for n, p in run.mod.named_parameters():
        err = float((p.detach().full_tensor() - params[n].detach()).abs().max()) / scale  # type: ignore[attr-defined]
        run.result.param_error = max(run.result.param_error, err)
        if err > tol:
            _note(run, f"step {step}: {n} after the optimizer step off by {err:.1e} (relative)")
    run.accumulated = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    run.ref.zero_grad(set_to_none=True)


def _one_step(run: _Run, step: int) -> bool:
    case = run.case
    if case.zero_grad:
        run.mod.zero_grad(set_to_none=True)
        run.accumulated = {n: None for n in run.accumulated}
    local: Grads = {n: None for n in run.accumulated}
    for micro in range(case.micro):
        for root in run.roots:
            root.set_requires_gradient_sync(micro == case.micro - 1)  # type: ignore[operator]
        x = _inputs(case, step, micro, run.rank)
        set_step(run.ref, case, step, micro, run.rank)
        set_step(run.mod, case, step, micro, run.rank)
        for n, g in _reference_grads(run, x).items():
            before = local[n]
            local[n] = g if before is None else before + (g if g is not None else 0)
        _loss(run.mod(x)).backward()
    want = _average(run, local)
    if not _check_grads(run, step, want):
        return False
    _step_both(run, step, want)
    busy = [
        m.__class__.__name__
        for m in run.units
        if (s := fsdp_state(m)) and s.unit.training_state is not TrainingState.IDLE
    ]
    if busy:
        _note(run, f"step {step}: units not idle: {busy}")
    return True


def check_rank(case: Case, rank: int, tamper: Callable[[nn.Module, int], None] | None = None) -> Result:
    """Run ``case`` for its steps on this rank (the default process group holds
    ``case.world`` ranks); returns the :class:`Result` over every rank, the same on each.
    ``tamper(model, rank)``, when given, is called on the sharded model once it is built (tests
    break it on purpose, to see the checks fail)."""
    run = _build(case, rank)
    if tamper is not None:
        tamper(run.mod, rank)
    for step in range(STEPS):
        if not _one_step(run, step):
            break
    every = collectives.all_gather_object(run.result, collectives.default_group())
    return Result(
        [line for r in every for line in r.failures][:6],
        max(r.grad_error for r in every),
        max(r.norm_error for r in every),
        max(r.param_error for r in every),
    )


def worker(case: Case, timeout_s: float) -> Result:
    """:func:`check_rank` in a process started by :func:`fullshard.jobs.launch.launch`, with a
    process group whose collectives give up after ``timeout_s`` seconds."""
    launch.init_process_group(timeout_s=timeout_s)
    try:
        return check_rank(case, launch.rank())
    finally:
        launch.destroy_process_group()
