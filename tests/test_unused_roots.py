"""``set_reduce_scatter_unused_params(True)`` in a backward that runs through several
``fully_shard`` roots (``loss = dec(enc(x))``, each module its own root): the flagged tree's
turns must not land among the other tree's collectives at a rank-dependent point.

A :class:`~test_unused_order.Gate` is flagged and some ranks skip it: its post-backward fires
on those that use it and not on the others, which reduce its zeros at their tree's end. Every
unit of the flagged tree stays gathered after forward, so that tree alone gathers nothing in
backward; the other tree's units reshard after forward (backward all-gathers them) and every
unit is of one size, so a reduction paired crosswise with the other tree's collectives would
not fail: wrong gradients, no error (found by review on 2026-11-29).
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from test_unused_order import Gate, assert_averaged, hsdp_mesh
from torch import nn


class Tower(nn.Module):
    """``b(tanh(a(h)))`` and, with ``gated``, a :class:`Gate` ``g`` before them."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.g = Gate() if gated else None
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.g is not None:
            h = self.g(h)
        return self.b(torch.tanh(self.a(h)))


class EncDec(nn.Module):
    def __init__(self, gated: str) -> None:
        super().__init__()
        self.enc, self.dec = Tower(gated == "enc"), Tower(gated == "dec")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.enc(x)))


def two_roots_body(rank: int, world: int, gated: str, micro: int) -> list[str]:
    """Two steps, the gate used on rank 0 in the first and on the last rank in the second;
    ``micro`` micro-batches a step, each one's forward before any backward. Returns the order
    of all-gathers and reduce-scatters of the last step."""
    import fullshard
    from fullshard.comm import flight_recorder

    mesh = hsdp_mesh(world == 4)
    torch.manual_seed(0)
    ref = EncDec(gated)
    mod = copy.deepcopy(ref)
    for tower in (mod.enc, mod.dec):
        flagged = tower.g is not None
        for m in ([tower.g] if flagged else []) + [tower.a, tower.b]:
            fullshard.fully_shard(m, mesh=mesh, reshard_after_forward=not flagged)
        fullshard.fully_shard(tower, mesh=mesh)
        if flagged:
            tower.g.set_reduce_scatter_unused_params(True, recurse=False)
        for unit in tower.modules():
            if isinstance(unit, fullshard.FSDPModule):
                unit.set_modules_to_backward_prefetch([])
    for step, users in enumerate(([0], [world - 1])):
        xs = [
            torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + 10 * i + rank)) for i in range(micro)
        ]
        for model in (ref, mod):
            getattr(model, gated).g.use = rank in users
            model.zero_grad(set_to_none=True)
        for x in xs:
            ref(x).square().mean().backward()
        flight_recorder.RECORDER.entries.clear()
        losses = [mod(x).square().mean() for x in xs]
        for loss in losses:
            loss.backward()
        assert_averaged(ref, mod, world, f"{gated} step {step}")
    return [f"{e.op} {e.unit}" for e in flight_recorder.RECORDER.entries if e.op in ("all_gather", "reduce_scatter")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("gated", "world", "micro"), [("dec", 2, 1), ("dec", 4, 1), ("enc", 2, 1), ("enc", 3, 1), ("dec", 2, 2)]
)
def test_a_flagged_tree_in_a_backward_through_another_root_reduces_at_its_end(
    gated: str, world: int, micro: int
) -> None:
    """The flagged tree's turns from the gate's on wait for its end callback, where they launch
    after everything the other tree did during backward, on every rank: the decoder's (its
    backward first, before the encoder's all-gathers) and the encoder's (its backward last, its
    end callback after the decoder's). At 4 ranks, HSDP 2x2; with 2 micro-batches, both
    forwards before the first backward (the encoder still open for the second)."""
    ops = run_ranks(two_roots_body, world, gated, micro, timeout=130)
    assert all(o == ops[0] for o in ops), ops
