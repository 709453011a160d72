"""Gradient clipping over shards equals the unsharded norm; summon_full_params shows full params."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dist import run_ranks
from models import batch, make_stack
from torch import nn


def _mixed_units(ref):
    """Root FULL_SHARD, blocks 0-1 NO_SHARD, block 2 SHARD_GRAD_OP, block 3 in the root."""
    from fullshard import FSDP, ShardingStrategy

    model = copy.deepcopy(ref)
    for i in (0, 1):
        model.blocks[i] = FSDP(model.blocks[i], sharding_strategy=ShardingStrategy.NO_SHARD)
    model.blocks[2] = FSDP(model.blocks[2], sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    return FSDP(model)


def clip_body(rank: int, world: int) -> list[float]:
    import fullshard

    norms = []
    n = 12 // world
    for norm_type, use_method in ((2.0, True), (math.inf, True), (1.0, False), (2.0, False)):
        ref = make_stack()
        model = _mixed_units(ref)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            x, y = batch(step, 12)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
            if use_method:
                total = model.clip_grad_norm_(0.05, norm_type)
            else:  # torch's keywords: foreach=False the second time
                total = fullshard.clip_grad_norm_(
                    model.parameters(), 0.05, norm_type, error_if_nonfinite=True, foreach=len(norms) < 3
                )
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
            ref_opt.step()
            assert want > 0.05  # clipping is active
            torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-7)
            full = model.state_dict()
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{norm_type} {k}: {m}")
        norms.append(float(total))
    poisoned = next(p for p in model.parameters() if p.grad is not None and p.grad.numel())
    poisoned.grad.view(-1)[0] = math.nan
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None and p is not poisoned]
    try:  # nan on one rank: every rank raises (the norm is global), no gradient scaled
        fullshard.clip_grad_norm_(model.parameters(), 0.05, error_if_nonfinite=True)
        raise AssertionError("a nan gradient was clipped")
    except RuntimeError as e:
        assert "error_if_nonfinite=False" in str(e), e
    kept = [p.grad for p in model.parameters() if p.grad is not None and p is not poisoned]
    assert len(kept) == len(grads) and all(torch.equal(a, b) for a, b in zip(grads, kept))
    return norms


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_clip_grad_norm_matches_unsharded(world: int) -> None:
    results = run_ranks(clip_body, world, timeout=180)
    assert all(r == results[0] for r in results)


def summon_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    done = []
    ref = make_stack()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    x, y = batch(0, 4 * world)
    torch.nn.functional.mse_loss(model(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4]).backward()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    # Full parameters (and gradients) inside; shards again outside.
    with FSDP.summon_full_params(model, with_grads=True):
        assert model.stem.weight.shape == (13, 6)
        named = dict(model.named_parameters())
        assert named["blocks.1.lin.weight"].shape == (7, 13)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(named[name].detach(), p.detach())
            torch.testing.assert_close(named[name].grad, p.grad, rtol=1e-5, atol=1e-6)
    assert model.stem.weight.shape[0] == math.ceil(13 / world) or model.stem.weight.shape[0] < 13
    done.append("full inside")
    # Writes are kept with writeback=True, dropped with writeback=False.
    with FSDP.summon_full_params(model), torch.no_grad():
        model.stem.weight.fill_(2.0)
    with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
        model.head.weight.fill_(5.0)
    sd = model.state_dict()
    assert torch.equal(sd["stem.weight"], torch.full((13, 6), 2.0))
    assert torch.equal(sd["head.weight"], ref.head.weight.detach())
    done.append("writeback")
    # rank0_only: only rank 0 sees full parameters; offload_to_cpu works on CPU too.
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
        full_rows = model.stem.weight.shape[0]
    assert (full_rows == 13) if rank == 0 else (full_rows < 13 or world == 1)
    done.append("rank0_only")
    with pytest.raises(ValueError, match="rank0_only"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass
    done.append("errors")
    # Nested (torch's refuses it): the outer context still shows full parameters, and a forward runs.
    with FSDP.summon_full_params(model, writeback=False):
        with FSDP.summon_full_params(model.blocks[1], writeback=False):
            assert model.blocks[1].lin.weight.shape == (7, 13)
        assert model.blocks[1].lin.weight.shape == (7, 13) and model.stem.weight.shape == (13, 6)
        model(x[:2])
    assert model.stem.weight.shape[0] < 13 or world == 1
    done.append("nested")
    # Training continues from the written values.
    torch.nn.functional.mse_loss(model(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4]).backward()
    return done


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 3])
def test_summon_full_params(world: int) -> None:
    expected = ["full inside", "writeback", "rank0_only", "errors", "nested"]
    assert run_ranks(summon_body, world, timeout=180)[0] == expected


def summon_no_grad_body(rank: int, world: int) -> list[str]:
    """summon_full_params(with_grads=True) leaves .grad None where there is none."""
    from fullshard import FSDP, ShardingStrategy

    done = []
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        m = FSDP(make_stack(), sharding_strategy=ShardingStrategy[strategy])
        m.module.head.requires_grad_(False)
        with FSDP.summon_full_params(m, with_grads=True):
            assert all(p.grad is None for p in m.parameters())
        done.append(strategy)
    return done


@pytest.mark.timeout(200)
def test_summon_with_grads_where_there_are_none() -> None:
    assert run_ranks(summon_no_grad_body, 2, timeout=180)[0] == ["FULL_SHARD", "SHARD_GRAD_OP"]
