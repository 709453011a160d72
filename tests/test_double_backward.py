"""Gradient penalties through sharded units: ``torch.autograd.grad(..., create_graph=True)``
then a backward through the graph it made (WGAN-GP, R1), as DDP users write them.

torch's FSDP1 and ``fully_shard`` both fail here ("setStorage: ... storage of size 0"): the
first backward's end reshards every unit, and the second reads the full parameters that the
created graph saved. fullshard keeps the units gathered after a backward that creates a graph,
until the next backward (or the next forward) reshards them, and matches an unsharded model
trained on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from torch import nn


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    block = lambda i, o: nn.Sequential(nn.Linear(i, o), nn.Tanh())  # noqa: E731
    return nn.Sequential(block(8, 16), block(16, 16), nn.Linear(16, 1))


def _shard(front_end: str, checkpointed: bool) -> nn.Module:
    import fullshard

    model = _model()
    if checkpointed:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(2):
            model[i] = checkpoint_wrapper(model[i])
    if front_end == "fully_shard":
        for i in range(2):
            fullshard.fully_shard(model[i])
        return fullshard.fully_shard(model)
    for i in range(2):
        model[i] = fullshard.FullyShardedDataParallel(model[i], use_orig_params=True)
    return fullshard.FullyShardedDataParallel(model, use_orig_params=True)


def _loss(model: nn.Module, x: torch.Tensor, penalty_only: bool) -> torch.Tensor:
    """The critic's loss with a gradient penalty on its input (``x``: shape (4, 8), float32)."""
    y = model(x)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    penalty = (gx.norm(dim=1) - 1).pow(2).mean()
    return penalty if penalty_only else y.mean() + penalty


def _full(model: nn.Module, front_end: str) -> torch.Tensor:
    import fullshard

    if front_end == "fully_shard":
        return torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    with fullshard.FullyShardedDataParallel.summon_full_params(model):
        return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def _units(model: nn.Module) -> list:
    from fullshard.engine.hooks import fsdp_state

    return list({id(s.unit): s.unit for m in model.modules() if (s := fsdp_state(m)) is not None}.values())


def penalty_body(
    rank: int, world: int, front_end: str, penalty_only: bool, checkpointed: bool, frozen: bool = False
) -> dict:
    from fullshard.engine.unit import ShardState, TrainingState

    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = _shard(front_end, checkpointed)
    if frozen:  # the middle unit's parameters all frozen (a pretrained block inside the critic)
        reference[1].requires_grad_(False)
        (model.module if front_end == "wrapper" else model)[1].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generators = [torch.Generator().manual_seed(r) for r in range(world)]
    idle_after_steps = []
    for _ in range(3):
        batches = [torch.randn(4, 8, generator=g) for g in generators]
        for x in batches:  # the unsharded model on every rank's batch: gradients averaged
            (_loss(reference, x.requires_grad_(), penalty_only) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _loss(model, batches[rank].detach().requires_grad_(), penalty_only).backward()
        opt.step()
        opt.zero_grad()
        units = _units(model)
        idle_after_steps.append(
            all(u.shard_state is ShardState.SHARDED and u.training_state is TrainingState.IDLE for u in units)
            and not any(u.has_pending_reduce for u in units)
        )
    # A penalty computed and dropped (logged only): the next forward starts from the shards.
    x = torch.randn(4, 8, generator=generators[rank], requires_grad=True)
    torch.autograd.grad(model(x).sum(), x, create_graph=True)
    after = model(torch.ones(2, 8))
    expected = reference(torch.ones(2, 8))
    return {
        "error": (_full(model, front_end) - torch.cat([p.detach().flatten() for p in reference.parameters()]))
        .abs()
        .max()
        .item(),
        "idle": idle_after_steps,
        "output_error": (after - expected).abs().max().item(),
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_gradient_penalty_matches_the_unsharded_model(front_end: str) -> None:
    for world in (2, 3):
        for penalty_only, checkpointed, frozen in (
            (False, False, False),
            (True, False, False),
            (False, True, False),
            (False, False, True),
            (True, False, True),
        ):
            for r in run_ranks(penalty_body, world, front_end, penalty_only, checkpointed, frozen, timeout=90):
                case = (world, penalty_only, checkpointed, frozen)
                # Two ranks average two gradients as the reference does: the same bits. Three
                # ranks pad the shards and add in another order.
                assert r["error"] <= (0.0 if world == 2 else 1e-6), (case, r)
                assert r["output_error"] <= 1e-6, (case, r)
                assert r["idle"] == [True, True, True], (case, r)


def accumulation_body(rank: int, world: int, front_end: str) -> list[str]:
    """Two micro-batches with a penalty each, gradient sync off for the first: the units whose
    gradients are reduced in the step, in order."""
    import contextlib

    from fullshard.engine.unit import Unit

    reduced = []
    real = Unit.reduce_grads

    def counting(self: Unit, *args: object, **kwargs: object) -> None:
        reduced.append(self.name)
        real(self, *args, **kwargs)

    Unit.reduce_grads = counting  # type: ignore[method-assign]
    try:
        model = _shard(front_end, False)
        for last in (False, True):
            if front_end == "fully_shard":
                model.set_requires_gradient_sync(last)
                context = contextlib.nullcontext()
            else:
                context = contextlib.nullcontext() if last else model.no_sync()
            with context:
                _loss(model, torch.randn(4, 8).requires_grad_(), False).backward()
    finally:
        Unit.reduce_grads = real  # type: ignore[method-assign]
    return reduced


@pytest.mark.timeout(100)
def test_gradient_penalty_under_accumulation_reduces_each_unit_once() -> None:
    # The penalty's create_graph backward used to reduce the sums held from the sync-off
    # micro-batch, then its own backward reduced each unit again.
    for front_end in ("fully_shard", "wrapper"):
        for reduced in run_ranks(accumulation_body, 2, front_end, timeout=80):
            assert sorted(reduced) == ["0", "1", "<root>"], (front_end, reduced)
