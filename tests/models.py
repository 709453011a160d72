"""Small models for the tests. Sizes are chosen so dim 0 often does not divide the world size."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Linear + LayerNorm + GELU, with a residual when shapes allow."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(self.norm(self.lin(x)))
        return y + x if y.shape == x.shape else y


class Stack(nn.Module):
    """A stem, four Blocks (13 and 7 rows: not divisible by 2, 3 or 4) and a 3-row head.

    Input float32 (batch, 6), output float32 (batch, 3).
    """

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 13)
        self.blocks = nn.ModuleList([Block(13, 13), Block(13, 7), Block(7, 7), Block(7, 13)])
        self.head = nn.Linear(13, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))  # a 0-dim parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale


def make_stack(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def batch(step: int, n: int, seed: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch (inputs (n, 6), targets (n, 3)) for step ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of a global batch along dim 0."""
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def step_both(model, opt, ref, ref_opt, step: int, rank: int, world: int, global_batch: int = 12) -> None:
    """One MSE training step of the sharded model on this rank's share and of the reference on
    the whole global batch (same data: ``batch(step, global_batch)``)."""
    x, y = batch(step, global_batch)
    device = next(ref.parameters()).device
    x, y = x.to(device), y.to(device)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world)).backward()
    opt.step()
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
