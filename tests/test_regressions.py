"""Cases found in review: forwards without backward, a backward that raises, recomputation with
forward prefetch, and gradients summoned where none exist."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import Block, batch, local, make_stack


class _FailOnce(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("boom in backward")
        return g


def body(rank: int, world: int, strategy: str) -> list[str]:
    from fullshard import FSDP, ShardingStrategy, checkpoint_wrapper, probes
    from fullshard.engine.unit import ShardState, TrainingState
    from fullshard.frontend.wrap import ModuleWrapPolicy

    mse = torch.nn.functional.mse_loss
    done = []
    # 1. A forward with grad enabled and no backward (a metric) between backward and step.
    ref = make_stack()
    model = FSDP(
        copy.deepcopy(ref), sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=ModuleWrapPolicy({Block})
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step, 8)
        opt.zero_grad()
        ref_opt.zero_grad()
        mse(model(local(x, rank, world)), local(y, rank, world)).backward()
        mse(ref(x), y).backward()
        model(x)  # without torch.no_grad(): leaves gathered units behind
        opt.step()
        ref_opt.step()
        out = model(x)
        torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)  # no stale parameters
        out.sum().backward()
        opt.zero_grad()
    done.append("forward without backward")

    # 2. A backward that raises; the step is retried.
    _FailOnce.armed = True
    xs = local(batch(0, 8)[0], rank, world).requires_grad_()
    with pytest.raises(RuntimeError, match="boom in backward"):
        model(_FailOnce.apply(xs)).sum().backward()
    opt.zero_grad()
    model(_FailOnce.apply(xs)).sum().backward()
    assert all(s is TrainingState.IDLE for s in model.training_states())
    assert all(m.unit.shard_state is ShardState.SHARDED for m in model.fsdp_modules(model))
    assert all(p.grad is not None for p in model.parameters())
    done.append("backward raised")

    # 3. Recomputation under activation checkpointing prefetches nothing extra.
    counts = []
    for prefetch in (False, True):
        m = make_stack()
        for i in range(len(m.blocks)):
            m.blocks[i] = checkpoint_wrapper(
                FSDP(m.blocks[i], forward_prefetch=prefetch, sharding_strategy=ShardingStrategy[strategy])
            )
        m = FSDP(m, forward_prefetch=prefetch, sharding_strategy=ShardingStrategy[strategy])
        for _ in range(2):  # the second step has a recorded forward order to prefetch from
            with probes.enabled(events=True) as p:
                m(local(batch(0, 8)[0], rank, world)).sum().backward()
            events = p.events or []
        counts.append(sum(e == "unshard" for e, _ in events))
    assert counts[1] == counts[0], counts
    done.append("recompute prefetch")

    # 4. summon_full_params(with_grads=True) leaves .grad None where there is none.
    m = FSDP(make_stack(), sharding_strategy=ShardingStrategy[strategy])
    m.module.head.requires_grad_(False)
    with FSDP.summon_full_params(m, with_grads=True):
        assert all(p.grad is None for p in m.parameters())
    return done


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_review_regressions(strategy: str) -> None:
    assert run_ranks(body, 2, strategy, timeout=180)[0] == [
        "forward without backward",
        "backward raised",
        "recompute prefetch",
    ]
