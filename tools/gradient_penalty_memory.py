"""Peak live tensor bytes of a gradient-penalty step against a plain one, unwrapped and sharded.

A 6-block MLP (blocks of ``Linear(512, 512)`` + Tanh, then ``Linear(512, 1)``: 6.0 MiB of fp32
parameters) at 2 gloo ranks, batch 32 per rank, SGD. For each of the unwrapped model and
``fully_shard`` per block, the third step's peak on rank 0
(:class:`~fullshard.plan.tracker.LiveTensorBytes`, parameters and gradients included), with the
loss ``y.mean()`` and with a WGAN-GP penalty added
(``torch.autograd.grad(y.sum(), x, create_graph=True)``). A backward that creates a graph leaves
every unit gathered until the second backward (:func:`fullshard.engine.hooks._backward_done`).

Usage (nothing is timed)::

    PYTHONPATH=src:tests python tools/gradient_penalty_memory.py
"""

from __future__ import annotations

import torch
from dist import run_ranks
from torch import nn

WIDTH, BLOCKS = 512, 6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 1))


def peak(rank: int, world: int, sharded: bool, penalty: bool) -> int:
    """The third step's peak live bytes on this rank (bytes)."""
    import fullshard
    from fullshard.plan.tracker import LiveTensorBytes

    model = _model()
    if sharded:
        for i in range(BLOCKS):
            fullshard.fully_shard(model[i])
        fullshard.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(32, WIDTH, generator=g, requires_grad=True)
        with LiveTensorBytes() as live:
            live.adopt([*model.parameters(), *(p.grad for p in model.parameters())])
            y = model(x)
            loss = y.mean()
            if penalty:
                (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
                loss = loss + (gx.norm(dim=1) - 1).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return live.peak


if __name__ == "__main__":
    print("| model | loss | rank 0 peak (MiB) |\n|---|---|---|")
    for sharded in (False, True):
        for penalty in (False, True):
            bytes_ = run_ranks(peak, 2, sharded, penalty, timeout=120)[0]
            name = "fully_shard per block" if sharded else "unwrapped"
            print(f"| {name} | {'y.mean() + gradient penalty' if penalty else 'y.mean()'} | {bytes_ / 2**20:.2f} |")
