"""A forward or a backward that raised leaves training as an unsharded model's, on both front
ends, without ``reset_iter_state``.

A program may catch an exception from a step (a bad batch skipped, an evaluation that failed,
an out-of-memory error in backward), call ``zero_grad`` and go on training. Each case trains a
TinyLM (per-block units and a root) with AdamW at 2 ranks twice in one process group, once with
the failure and once without it, and the losses and final parameters must be equal bit for bit:

- a forward that raises inside ``layers.1`` (with and without grad) between step 1's backward
  and its optimizer step: the units it gathered must not be used after the optimizer stepped;
- a backward that raises at the loss, or at ``layers.1``'s output once ``layers.2`` and the
  head have reduced, alone or after a micro-batch accumulated with gradient sync off; the run
  without it skips that step. Reductions in flight and gradients not yet reduced must not reach
  the next step's ``.grad`` after ``zero_grad``;
- the wrapper only: a forward that raises inside ``layers.1``, or an error between forward and
  backward, after a micro-batch accumulated under ``no_sync``: the ``zero_grad`` that follows
  must drop that micro-batch, as it does when no step failed (torch FSDP1 with
  ``use_orig_params``); ``fully_shard`` keeps it, by torch FSDP2's rule;
- an optimizer step that raises before it updates anything (AdamW's update function replaced by
  one that raises); the run without it skips that step. ``fully_shard``'s step on local tensors
  leaves its stand-in parameters in the optimizer then, and a ``zero_grad`` of the stand-ins
  must still clear the gradients the next backward would add to.

torch's own FSDP does not hold to this (torch 2.13, CPU, against the unsharded model): after the
forward, its ``fully_shard`` and its FSDP1 (``use_orig_params=True``) compute the next steps with
parameters gathered before the optimizer step; after the backward at layers.1, its
``fully_shard`` (1 and 2 ranks) and FSDP1 (2 ranks) carry gradients of the failed step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from dist import patched, run_ranks
from models import TinyBlock, TinyLM, local, tokens


class _Boom(Exception):
    pass


def _raise(*_: object, **__: object) -> None:
    raise _Boom()


def _build(front: str) -> torch.nn.Module:
    import fullshard
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TinyLM(layers=3)
    if front == "fsdp1":
        return fullshard.FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TinyBlock}), use_orig_params=True)
    for layer in model.layers:
        fullshard.fully_shard(layer)
    return fullshard.fully_shard(model)


def _training(front: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """(the sharded TinyLM, the module under the wrapper or the model itself, AdamW over it)."""
    model = _build(front)
    return model, model.module if front == "fsdp1" else model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model: torch.nn.Module, inner: torch.nn.Module) -> dict[str, torch.Tensor]:
    from fullshard.frontend.summon import summon_full_params

    with summon_full_params(model):
        return {n: p.detach().clone() for n, p in inner.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _train(rank: int, world: int, front: str, abort: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, inner, opt = _training(front)
    losses = []
    for step in range(4):
        x = local(tokens(step, 4), rank, world)
        loss = model(x).pow(2).mean()
        loss.backward()
        if step == 1 and abort is not None:
            hook = inner.layers[1].w1.register_forward_pre_hook(_raise)
            with pytest.raises(_Boom), torch.set_grad_enabled(abort == "grad"):
                model(x)
            hook.remove()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _full(model, inner)


def _with_and_without(rank: int, world: int, front: str, abort: str) -> tuple[bool, list[float], list[float]]:
    clean_losses, clean = _train(rank, world, front, None)
    losses, full = _train(rank, world, front, abort)
    return _same(clean, full), clean_losses, losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("front", ["fully_shard", "fsdp1"])
@pytest.mark.parametrize("abort", ["no_grad", "grad"])
def test_forward_that_raised_changes_nothing(front: str, abort: str) -> None:
    for same, clean_losses, losses in run_ranks(_with_and_without, 2, front, abort, timeout=220):
        assert losses == clean_losses
        assert same


def _refused_then_recovered(rank: int, world: int, refuse: bool) -> tuple[list[float], list[bool]]:
    """A requires_grad change that fully_shard refuses inside its forward hook (an unfreeze
    between two micro-batches with gradient sync off for the first), undone: training goes on as
    if it had never been tried."""
    model = _build("fully_shard")
    model.layers[1].w1.weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, refused = [], []
    for step in range(4):
        x = local(tokens(step, 8), rank, world)
        model.set_requires_gradient_sync(False)
        model(x[:1]).pow(2).mean().backward()
        model.set_requires_gradient_sync(True)
        if step == 2 and refuse:
            model.layers[1].w1.weight.requires_grad_(True)
            with pytest.raises(RuntimeError, match="while gradients accumulated without a reduction") as e:
                model(x[1:])
            refused.append(e is not None)
            model.layers[1].w1.weight.requires_grad_(False)
        loss = model(x[1:]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, refused


@pytest.mark.timeout(240)
def test_refusal_in_a_forward_hook_leaves_the_model_usable() -> None:
    clean = run_ranks(_refused_then_recovered, 2, False, timeout=220)
    refused = run_ranks(_refused_then_recovered, 2, True, timeout=220)
    for (clean_losses, _), (losses, was_refused) in zip(clean, refused):
        assert was_refused == [True]
        assert losses == clean_losses


def _hook_output(block: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    def hook(_: torch.nn.Module, __: tuple, out: torch.Tensor) -> None:
        out.register_hook(_raise)

    return block.register_forward_hook(hook)


def _skip_or_fail(rank: int, world: int, front: str, where: str | None, accumulate: bool) -> tuple[list[float], dict]:
    """Four steps; step 1 fails in backward (``where``: "loss" or "layers.1"), in forward
    ("forward": inside layers.1) or between forward and backward ("after forward") after an
    optional micro-batch with sync off, or is skipped (``where`` None)."""
    model, inner, opt = _training(front)
    losses = []
    for step in range(4):
        x = local(tokens(step, 8), rank, world)
        if step == 1:
            if where is None:
                continue
            if accumulate:
                sync_off = model.no_sync() if front == "fsdp1" else contextlib.nullcontext()
                if front != "fsdp1":
                    model.set_requires_gradient_sync(False)
                with sync_off:
                    model(x[:1]).pow(2).mean().backward()
                if front != "fsdp1":
                    model.set_requires_gradient_sync(True)
            hook = _hook_output(inner.layers[1]) if where == "layers.1" else None
            if where == "forward":
                hook = inner.layers[1].w1.register_forward_pre_hook(_raise)
            with pytest.raises(_Boom):
                out = model(x[1:])
                if where == "loss":
                    out.register_hook(_raise)
                if where == "after forward":
                    _raise()
                out.pow(2).mean().backward()
            if hook is not None:
                hook.remove()
            opt.zero_grad()
            continue
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _full(model, inner)


def _backward_failed(rank: int, world: int, front: str, where: str, accumulate: bool) -> tuple[bool, list, list]:
    clean_losses, clean = _skip_or_fail(rank, world, front, None, accumulate)
    losses, full = _skip_or_fail(rank, world, front, where, accumulate)
    return _same(clean, full), clean_losses, losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("front", ["fully_shard", "fsdp1"])
@pytest.mark.parametrize(("where", "accumulate"), [("loss", False), ("layers.1", False), ("layers.1", True)])
def test_backward_that_raised_leaves_nothing_after_zero_grad(front: str, where: str, accumulate: bool) -> None:
    for same, clean_losses, losses in run_ranks(_backward_failed, 2, front, where, accumulate, timeout=220):
        assert losses == clean_losses
        assert same


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["forward", "after forward"])
def test_zero_grad_after_a_forward_that_raised_drops_no_sync_micro_batches(where: str) -> None:
    """The wrapper only: ``fully_shard`` keeps what ``set_requires_gradient_sync(False)``
    accumulated through ``zero_grad``, as torch's FSDP2 does, so there the micro-batch joins the
    next step unless the program calls ``reset_iter_state``."""
    for same, clean_losses, losses in run_ranks(_backward_failed, 2, "fsdp1", where, True, timeout=220):
        assert losses == clean_losses
        assert same


def _step_skipped_or_failed(rank: int, world: int, front: str, fail: bool) -> tuple[list[float], dict]:
    """Four steps; step 1's ``optimizer.step()`` raises (``fail``) or step 1 is skipped."""
    import torch.optim.adam as adam  # torch.optim's namespace drops the submodule's name

    model, inner, opt = _training(front)
    losses = []
    for step in range(4):
        x = local(tokens(step, 8), rank, world)
        if step == 1 and not fail:
            continue
        loss = model(x).pow(2).mean()
        loss.backward()
        if step == 1:
            with patched(adam, adam=_raise), pytest.raises(_Boom):
                opt.step()
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _full(model, inner)


def _step_failed(rank: int, world: int, front: str) -> tuple[bool, list, list]:
    clean_losses, clean = _step_skipped_or_failed(rank, world, front, False)
    losses, full = _step_skipped_or_failed(rank, world, front, True)
    return _same(clean, full), clean_losses, losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("front", ["fully_shard", "fsdp1"])
def test_optimizer_step_that_raised_leaves_nothing_after_zero_grad(front: str) -> None:
    for same, clean_losses, losses in run_ranks(_step_failed, 2, front, timeout=220):
        assert losses == clean_losses
        assert same
