"""Activation checkpointing inside and outside FSDP units: same results, less memory."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import Block, make_stack, step_both
from torch import nn


def parity_body(rank: int, world: int) -> list[str]:
    from fullshard import (
        FSDP,
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from fullshard.wrap import ModuleWrapPolicy

    done = []
    for placement in ("inside", "outside", "offload"):
        ref = make_stack()
        model = copy.deepcopy(ref)
        if placement == "inside":  # FSDP(CheckpointWrapper(Block)): applied after wrapping
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
            assert isinstance(model.blocks[0].module, CheckpointWrapper)
        elif placement == "outside":  # CheckpointWrapper(FSDP(Block))
            blocks = model.blocks
            for i in range(len(blocks)):
                blocks[i] = checkpoint_wrapper(FSDP(blocks[i]))
            model = FSDP(model)
        else:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block), offload_to_cpu=True)
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({CheckpointWrapper}))
        assert [k for k, _ in model.named_parameters()] == [k for k, _ in ref.named_parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            step_both(model, opt, ref, ref_opt, step, rank, world)
        full = model.state_dict()
        assert list(full) == list(ref.state_dict())
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{placement} {k}: {m}")
        done.append(placement)
    return done


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_checkpointing_parity(world: int) -> None:
    assert run_ranks(parity_body, world, timeout=180)[0] == ["inside", "outside", "offload"]


def test_seed_example_runs_on_one_rank_without_fsdp() -> None:
    from fullshard import checkpoint_wrapper

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    model = nn.Sequential(checkpoint_wrapper(Layer(), offload_to_cpu=True), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    assert list(model.state_dict()) == ["0.lin.weight", "0.lin.bias", "1.weight", "1.bias"]
    assert model[0].lin.weight.grad is not None


class Wide(nn.Module):
    """Blocks whose intermediate activations are 9x their input: recomputation pays off."""

    def __init__(self, d: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def memory_body(rank: int, world: int) -> dict:
    """Peak RSS after a checkpointed step, then after a plain one: the plain one adds more."""
    from fullshard import FSDP, apply_activation_checkpointing, peak_rss_bytes
    from fullshard.wrap import ModuleWrapPolicy

    x = torch.randn(4096, 256)
    torch.manual_seed(0)
    checkpointed = FSDP(Wide(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    apply_activation_checkpointing(checkpointed, check_fn=lambda m: isinstance(m, nn.Sequential))
    for _ in range(2):
        checkpointed(x).sum().backward()
    after_checkpointed = peak_rss_bytes()
    torch.manual_seed(0)
    plain = FSDP(Wide(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    for _ in range(2):
        plain(x).sum().backward()
    after_plain = peak_rss_bytes()
    grads_equal = all(
        torch.allclose(a.grad, b.grad / 2, rtol=1e-4, atol=1e-5) or torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)
        for a, b in zip(checkpointed.parameters(), plain.parameters())
    )
    return {"extra": after_plain - after_checkpointed, "grads_equal": grads_equal}


@pytest.mark.timeout(200)
def test_checkpointing_lowers_activation_memory() -> None:
    r = run_ranks(memory_body, 1, timeout=180)[0]
    # Without checkpointing each of 6 blocks keeps ~9 x 4 MiB of activations (~216 MiB);
    # with it, only each block's 4 MiB input. The plain run must need well over 100 MiB more.
    assert r["extra"] > 100 * 2**20, r
    assert r["grads_equal"]
