"""The seed documents' snippets run with only the import changed, and the loss falls."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from dist import run_ranks
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.layers(x)


def _train(model, rank: int, steps: int = 15) -> tuple[float, float]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 16, generator=g)
    y = x[:, :4].sin()  # a learnable target
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def snippets_body(rank: int, world: int) -> list[tuple[float, float]]:
    from fullshard import CPUOffload, ShardingStrategy
    from fullshard import FullyShardedDataParallel as FSDP
    from fullshard.frontend.wrap import size_based_auto_wrap_policy

    results = []
    torch.manual_seed(0)
    # 000/001: mixed precision given as a bare dtype.
    model = FSDP(Model(), sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=torch.float16)
    results.append(_train(model, rank))
    # 001: the cpu_offload shorthand (a no-op on CPU, said once).
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        model = FSDP(Model(), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, cpu_offload=True)
    results.append(_train(model, rank))
    # 002: the tutorial's old keyword with CPUOffload.
    torch.manual_seed(0)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=1000)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        model = FSDP(Model(), fsdp_auto_wrap_policy=policy, cpu_offload=CPUOffload(offload_params=True))
    assert len(FSDP.fsdp_modules(model)) == 3  # the two larger Linears are their own units
    results.append(_train(model, rank))
    return results


@pytest.mark.timeout(200)
def test_seed_snippets_train() -> None:
    for first, last in run_ranks(snippets_body, 2, timeout=180)[0]:
        assert last < 0.5 * first, (first, last)


def offload_warning_body(rank: int, world: int) -> int:
    from fullshard import FSDP
    from fullshard.engine import build

    build._warned_offload_on_cpu = False  # a kept rank may have warned in an earlier test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(Model(), cpu_offload=True)
        FSDP(Model(), cpu_offload=True)
    return sum("no effect on a CPU-only run" in str(w.message) for w in caught)


@pytest.mark.timeout(120)
def test_cpu_offload_on_cpu_says_so_once() -> None:
    assert run_ranks(offload_warning_body, 2, timeout=100) == [1, 1]
