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
import dataclasses

import pytest
import torch
import torch.utils.checkpoint
from dist import run_ranks
from test_unused_order import Gate, assert_averaged, hsdp_mesh
from torch import nn


@dataclasses.dataclass
class Boxed:
    """A root's output that is no pytree node: no hook of the root's own finds its tensor."""

    h: torch.Tensor


class Tower(nn.Module):
    """``b(tanh(a(h)))`` and, with ``gated``, a :class:`Gate` ``g`` before them; with ``boxed``,
    the result in a :class:`Boxed`."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.g = Gate() if gated else None
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.boxed = False

    def forward(self, h: torch.Tensor) -> torch.Tensor | Boxed:
        if self.g is not None:
            h = self.g(h)
        out = self.b(torch.tanh(self.a(h)))
        return Boxed(out) if self.boxed else out


def unbox(out: torch.Tensor | Boxed) -> torch.Tensor:
    return out.h if isinstance(out, Boxed) else out


class EncDec(nn.Module):
    def __init__(self, gated: str) -> None:
        super().__init__()
        self.enc, self.dec = Tower(gated == "enc"), Tower(gated == "dec")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unbox(self.dec(torch.tanh(unbox(self.enc(x)))))


def _step(model: EncDec, xs: list[torch.Tensor], mode: str) -> None:
    """One step's forwards and backwards, as ``mode`` says (the same for both models)."""
    if mode == "micro":  # both micro-batches' forwards before either backward
        losses = [model(x).square().mean() for x in xs]
        for loss in losses:
            loss.backward()
    elif mode == "retain":  # a second backward through the kept graph, after the first one's end
        y = model(xs[0])
        y.square().mean().backward(retain_graph=True)
        y.sum().backward()
    elif mode == "shared":  # two losses over one encoder, backward one by one
        h = torch.tanh(unbox(model.enc(xs[0])))
        first, second = h.sum(), model.dec(h).square().mean()
        first.backward(retain_graph=True)
        second.backward()
    elif mode == "reentrant":  # the whole encoder root in a reentrant checkpoint
        h = torch.utils.checkpoint.checkpoint(model.enc, xs[0].requires_grad_(), use_reentrant=True)
        model.dec(torch.tanh(h)).square().mean().backward()
    elif mode == "reentrant_input":  # the same, the encoder's own input made inside (needs no grad)
        h = torch.utils.checkpoint.checkpoint(lambda t: model.enc(t * 2.0), xs[0].requires_grad_(), use_reentrant=True)
        model.dec(torch.tanh(h)).square().mean().backward()
    else:
        model(xs[0]).square().mean().backward()


def two_roots_body(rank: int, world: int, gated: str, mode: str) -> list[str]:
    """Two steps, the gate used on rank 0 in the first and on the last rank in the second, each
    step as :func:`_step` runs ``mode``. Returns the order of all-gathers and reduce-scatters of
    the last step."""
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
    for model in (ref, mod):
        model.enc.boxed = mode == "boxed"
    for step, users in enumerate(([0], [world - 1])):
        xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + 10 * i + rank)) for i in range(2)]
        for model in (ref, mod):
            getattr(model, gated).g.use = rank in users
            model.zero_grad(set_to_none=True)
        _step(ref, [x.clone() for x in xs], mode)
        flight_recorder.RECORDER.entries.clear()
        _step(mod, [x.clone() for x in xs], mode)
        assert_averaged(ref, mod, world, f"{gated} {mode} step {step}")
    return [f"{e.op} {e.unit}" for e in flight_recorder.RECORDER.entries if e.op in ("all_gather", "reduce_scatter")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("gated", "world", "mode"),
    [
        ("dec", 2, "plain"),
        ("dec", 4, "plain"),
        ("enc", 2, "plain"),
        ("enc", 3, "plain"),
        ("dec", 2, "micro"),
        ("dec", 2, "retain"),
        ("dec", 2, "shared"),
        ("dec", 2, "reentrant"),
        ("dec", 2, "reentrant_input"),
        ("dec", 2, "boxed"),
    ],
)
def test_a_flagged_tree_in_a_backward_through_another_root_reduces_at_its_end(
    gated: str, world: int, mode: str
) -> None:
    """The flagged tree's turns from the gate's on wait for its end callback, where they launch
    after everything the other tree did during backward, on every rank: the decoder's (its
    backward first, before the encoder's all-gathers) and the encoder's (its backward last, its
    end callback after the decoder's). At 4 ranks, HSDP 2x2. Also where the other root's
    backward comes again after its end callback (``retain``: a second backward through the kept
    graph; ``shared``: a loss of the encoder alone first), with both micro-batches' forwards
    before either backward (``micro``), with the encoder's forward run without grad in a
    reentrant checkpoint (``reentrant``: its forward with grad comes inside the backward; in
    ``reentrant_input`` its input is made inside the checkpoint and needs no gradient), and with
    the encoder's output in a plain dataclass (``boxed``: no hook of the root's own sees it;
    found by review)."""
    ops = run_ranks(two_roots_body, world, gated, mode, timeout=130)
    assert all(o == ops[0] for o in ops), ops


def seen_body(rank: int, world: int) -> list[bool]:
    """Whether the student's tree holds its turns (another root seen) after each teacher pass."""
    import fullshard
    from fullshard.engine import reduce_order
    from fullshard.engine.hooks import fsdp_state

    torch.manual_seed(0)
    frozen, teacher, student = Tower(False).requires_grad_(False), Tower(False), Tower(True)
    for tower in (frozen, teacher, student):
        fullshard.fully_shard(tower)
    x = torch.randn(3, 4)
    student(x).sum().backward()
    root = fsdp_state(student).root  # type: ignore[union-attr]
    answers = []
    with torch.no_grad():
        frozen(x)  # a frozen teacher's pass: its backward never comes
    answers.append(reduce_order.others_open(root))
    with torch.no_grad():
        teacher(x)  # trainable: as a reentrant checkpoint's first pass, its backward to come
    answers.append(reduce_order.others_open(root))
    return answers


@pytest.mark.timeout(60)
def test_a_root_run_without_grad_counts_only_where_its_backward_may_come() -> None:
    """A root run under ``torch.no_grad()`` with no trainable parameter (a frozen teacher, a
    reference model) leaves the other trees' turns as they were; a root with trainable
    parameters run without grad (reentrant checkpointing's first pass, its forward with grad
    coming inside the next backward) makes them hold."""
    assert run_ranks(seen_body, 1, timeout=50) == [[False, True]]
