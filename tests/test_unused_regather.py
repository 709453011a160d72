"""A unit under ``set_reduce_scatter_unused_params(True)`` that backward needs more than once
per forward: reached by a second backward through a retained graph, or kept gathered across a
root called twice per step. Its post-backward fires only on the ranks whose backward gave its
parameters a gradient, so a reshard there left it sharded on those ranks alone, and the next
time backward needed it those ranks all-gathered it while the others did not: a hang, or with
units of one size crosswise pairs and wrong gradients (found by review on 2026-11-29). Such a
unit now reshards at backward's end on every rank, and a backward that begins with it resharded
by an earlier one gathers it again first, on every rank. A unit called twice in one forward
(``twice``) worked before and is kept as a guard: its post-backward comes once, after both calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from test_unused_order import Gate, assert_averaged, hsdp_mesh
from torch import nn


class GateTwice(nn.Module):
    """``out(g(h))`` with ``twice``, else ``out(h)``, where ``h = tanh(y(g(x)))``: ``g`` a
    :class:`Gate` some ranks skip. Its first call's input needs no gradient, so where it is
    skipped its output needs none either: backward does not reach that call there. With
    ``nograd_first``, ``g`` runs once under ``torch.no_grad()`` before (a target added to ``h``)."""

    def __init__(self) -> None:
        super().__init__()
        self.g, self.y, self.out = Gate(), nn.Linear(4, 4), nn.Linear(4, 4)
        self.twice = self.nograd_first = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = None
        if self.nograd_first:
            with torch.no_grad():
                target = self.g(x * 0.5)
        h = torch.tanh(self.y(self.g(x)))
        h = h if target is None else h + target
        return self.out(self.g(h) if self.twice else h)


def _step(model: nn.Module, x: torch.Tensor, mode: str) -> None:
    if mode.startswith("retain"):  # a second backward through the kept graph, after the first one's end
        out = model(x.requires_grad_() if mode == "retain_twice" else x)  # both calls' backwards read g's weight
        out.square().mean().backward(retain_graph=True)
        out.sum().backward()
    elif mode == "create_graph":  # a first backward that creates a graph (its end reshards nothing)
        out = model(x)
        out.square().mean().backward(create_graph=True, retain_graph=True)
        out.sum().backward()
    elif mode.startswith("pipe"):  # two forwards, then their backwards, the last first
        first, second = model(x), model(x * 2.0)
        second.square().mean().backward()
        first.square().mean().backward()
    elif mode == "root_twice":  # the root called twice in one step: its second forward's tidy-up
        model(torch.tanh(model(x))).square().mean().backward()
    else:
        model(x).square().mean().backward()


def regather_body(rank: int, world: int, mode: str) -> list[list[str]]:
    """Three steps, the gate used on rank 0, then on the last rank, then on rank 0 again, then
    an optimizer step each (not for ``root_twice``). ``g`` is flagged and kept gathered after forward (``resharded``:
    resharded after forward, gathered by each backward that reaches it, on every rank); it
    reshards after backward as by default. Returns each step's all-gathers and reduce-scatters."""
    import fullshard
    from fullshard.comm import flight_recorder
    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import ShardState

    mesh = hsdp_mesh(world == 4)
    torch.manual_seed(0)
    ref = GateTwice()
    ref.twice = mode in ("twice", "twice_resharded", "retain_twice")
    ref.nograd_first = mode.endswith("nograd_first")
    mod = copy.deepcopy(ref)
    fullshard.fully_shard(mod.g, mesh=mesh, reshard_after_forward=mode.endswith("resharded"))
    fullshard.fully_shard(mod.y, mesh=mesh)
    fullshard.fully_shard(mod.out, mesh=mesh)
    fullshard.fully_shard(mod, mesh=mesh)  # no parameter of its own
    mod.g.set_reduce_scatter_unused_params(True, recurse=False)
    for unit in (mod, mod.g, mod.y, mod.out):
        unit.set_modules_to_backward_prefetch([])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mod)]
    orders = []
    for step, users in enumerate(([0], [world - 1], [0])):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        for model in (ref, mod):
            model.g.use = rank in users
            model.zero_grad(set_to_none=True)
        _step(ref, x.clone(), mode)
        flight_recorder.RECORDER.entries.clear()
        _step(mod, x.clone(), mode)
        entries = flight_recorder.RECORDER.entries
        orders.append([f"{e.op} {e.unit}" for e in entries if e.op in ("all_gather", "reduce_scatter")])
        for p in ref.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        assert_averaged(ref, mod, world, f"{mode} step {step}")
        assert fsdp_state(mod.g).unit.shard_state is ShardState.SHARDED, (mode, step)  # type: ignore[union-attr]
        for opt in opts:  # assert_averaged averaged the reference's gradients in place
            if mode != "root_twice":  # without a step between, the second forward may reuse the gathered g
                opt.step()
    return orders


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("mode", "world"),
    [
        ("twice", 2),
        ("twice", 3),
        ("twice", 4),
        ("twice_resharded", 2),
        ("retain", 2),
        ("retain", 4),
        ("root_twice", 2),
        ("root_twice", 3),
        ("retain_twice", 2),
        ("retain_nograd_first", 2),
        ("pipe_nograd_first", 3),
        ("create_graph", 2),
    ],
)
def test_a_flagged_unit_reached_again_in_backward_stays_gathered_to_the_end(mode: str, world: int) -> None:
    """The gradients are the unsharded model's averaged, in one collective order on every rank
    (at 4 ranks HSDP 2x2), and ``g`` is sharded after each step. Kept gathered after forward, ``g``
    is all-gathered once per forward, and ``retain``'s second backward gathers it once more,
    first. Before 2026-11-29, ``retain`` and ``root_twice`` hung (``twice`` passed: autograd runs
    a parameter's accumulation once, after both calls' backward). Found by review then:
    ``retain_twice`` (the second backward's first split node resharded ``g`` before the other
    call's node read it), ``*_nograd_first`` (``g`` run first without grad was left out of the
    gather at a backward's start), ``create_graph`` (resharded where reached, and that backward's
    end reshards nothing: the next backward gathered it on those ranks alone)."""
    orders = run_ranks(regather_body, world, mode, timeout=130)
    assert all(o == orders[0] for o in orders), orders
    gathers = [o.count("all_gather g") for o in orders[0]]
    if mode in ("twice", "retain"):
        assert gathers == [2 if mode == "retain" else 1] * 3, (mode, orders[0])
