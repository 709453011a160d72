"""Parameters used on some ranks only, on drawn cases (``fullshard.jobs.planning.unused``):
rank-dependent routing, embeddings whose rows only some ranks see, branches some ranks take,
parameters no rank uses, each unit flagged (``set_reduce_scatter_unused_params``) or not within
the documented limits. Each case runs three steps against an unsharded model on every rank
(``unused_check.check_rank``: averaged gradients, ``.grad`` None or set alike on every rank,
hook counts, ``clip_grad_norm_``, SGD or AdamW steps). ``tools/unused_sweep.py`` runs more
draws at 2-4 ranks; here a few at 2 and 3 ranks, chosen to cover bf16, micro-batches, no
``zero_grad`` between steps, clipping that clips, experts wrapped one by one, unflagged
units with default prefetch, and models split in two roots (``dec(enc(x))``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist import run_ranks
from torch import nn

from fullshard.jobs.planning import unused, unused_check, unused_model

SEED = 20261129
# By world size: indices of draw(SEED, 34); 2, 6 and 7 reshard units beside flagged ones; 0, 6,
# 21 and 33 are split in two roots, and 6 has a frozen unit resharded in one tree beside a root
# block in a reentrant checkpoint in the other (both roots flagged). In 21 the first tree's
# experts, flagged, are reached on some ranks only, a flagged unit of it reshards, and the second
# tree (root flagged) runs its backward first: on 93f43d8 (before several roots held the turns),
# an all-gather failed. In 33 the second tree's flagged gate reshards and the first root, flagged,
# is reached twice (its block in a reentrant checkpoint): on 93f43d8 gloo aborted
CASES = {2: [0, 13], 3: [1, 2, 6, 7, 11, 21, 33]}


def _run(rank: int, world: int, indices: list[int]) -> list[unused_check.Result]:
    return [unused_check.check_rank(unused.case_at(SEED, i), rank) for i in indices]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", sorted(CASES))
def test_drawn_cases_match_the_unsharded_model(world: int) -> None:
    assert all(unused.case_at(SEED, i).world == world for i in CASES[world])
    results = run_ranks(_run, world, CASES[world], timeout=140)[0]
    for i, r in zip(CASES[world], results):
        assert r.passed and r.grad_error < 1e-5, (unused.case_at(SEED, i).describe(), r)


def _scale_one_grad(model: nn.Module, rank: int) -> None:
    """On rank 0, the head's bias gradient doubled once it lands."""
    if rank == 0:
        model.get_parameter("head.bias").register_post_accumulate_grad_hook(lambda p: p.grad.mul_(2))  # type: ignore[union-attr]


def _drop_one_grad(model: nn.Module, rank: int) -> None:
    """On rank 0, the head's weight left without a ``.grad``."""
    if rank == 0:
        model.get_parameter("head.weight").register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def _tampered(rank: int, world: int, index: int, how: str) -> unused_check.Result:
    tamper = {"scale": _scale_one_grad, "drop": _drop_one_grad}[how]
    return unused_check.check_rank(unused.case_at(SEED, index), rank, tamper)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("how, says", [("scale", "head.bias gradient off"), ("drop", "None on some ranks only")])
def test_the_checks_fail_on_a_broken_gradient(how: str, says: str) -> None:
    result = run_ranks(_tampered, 2, 13, how, timeout=90)[0]
    assert not result.passed and says in result.failures[0], result


def test_drawn_cases_keep_to_the_documented_limits() -> None:
    """Every unit touched on some ranks only is flagged, and then none prefetches in backward;
    only units touched on every rank in every micro-batch reshard after forward, and flagged
    or frozen whole-block units no rank skips where the input requires grad; every other unit
    touched on some ranks only is kept gathered; only the root's blocks skip forward; the draws
    are a prefix of longer draws; and the cases cover what they should, a unit resharded beside
    one touched on some ranks only too."""
    cases = unused.draw(SEED, 60)
    assert [c.describe() for c in unused.draw(SEED, 7)] == [c.describe() for c in cases[:7]]
    beside = 0
    for c in cases:
        _assert_trees_keep_to_the_limits(c)
        needy = resharded = False
        for b in c.blocks:
            assert not b.drop_forward or b.wrap == "none", c.describe()
            for u in range(len(b.unit_names(0))):
                touched = [sum(b.touched(u, use) for use in ranks) for step in b.uses for ranks in step]
                if any(0 < t < c.world for t in touched):
                    needy = True
                    assert b.flagged[u] and (b.kept[u] or (c.input_grad and unused._gate(b, u))), c.describe()
                if not b.kept[u]:
                    resharded = True
                    # reached everywhere: flagged (a gate), or frozen (all-gathers without a turn)
                    gate = c.input_grad and (unused._gate(b, u) or (b.frozen and unused._unskipped(b)))
                    assert gate or all(t == c.world for t in touched), c.describe()
        if needy:
            assert c.prefetch_off, c.describe()
        beside += needy and resharded
    assert beside >= 5, beside
    assert 10 <= sum(bool(c.split) for c in cases) <= 35 and any(c.root2_flagged for c in cases)
    assert {c.world for c in cases} == {2, 3, 4} and any(c.hsdp for c in cases) and any(c.mixed for c in cases)
    flags = [{"": c.root_flagged, "enc": c.root_flagged, "dec": c.root2_flagged} for c in cases]
    assert any(b.ckpt and not f[c.tree(i)] for c, f in zip(cases, flags) for i, b in enumerate(c.blocks))
    unflagged = [b for c in cases for b in c.blocks if b.wrap != "none" and not all(b.flagged)]
    assert any(b.habit in ("routed", "branch") for b in unflagged)  # partial use inside an unflagged unit


def _assert_trees_keep_to_the_limits(c: unused.Case) -> None:
    """A split case: the first tree's output requires grad on every rank in every micro-batch,
    its root's blocks are touched on every rank or none where its root is not flagged, and a
    block runs in a reentrant checkpoint only where the input requires grad (any root since
    2026-11-29: its gradient from the nested backward waits for the rest of the root's)."""
    assert c.input_grad or not any(b.ckpt for b in c.blocks), c.describe()
    if not c.split:
        return
    assert 0 < c.split < len(c.blocks), c.describe()
    first = c.blocks[: c.split]
    for step in range(unused.STEPS):
        for micro in range(c.micro):
            uses = [[b.uses[step][micro][r] for b in first] for r in range(c.world)]
            fed = [[u is not None and bool(u) and not b.frozen for b, u in zip(first, us)] for us in uses]
            assert c.input_grad or all(any(f) for f in fed), c.describe()
            own = {any(f and b.wrap == "none" for b, f in zip(first, fs)) for fs in fed}
            assert c.root_flagged or len(own) == 1, c.describe()


def test_a_split_case_is_the_unsplit_one_with_two_roots() -> None:
    """The same parameters, drawn alike (``enc.``/``dec.`` in front of their names), and the
    same output: splitting changes only where the roots are."""
    c = unused.case_at(SEED, 6)
    assert c.split == 1
    torch.manual_seed(0)
    split = unused_model.build(c)
    torch.manual_seed(0)
    whole = unused_model.build(dataclasses.replace(c, split=0, root2_flagged=False))
    names = [n.split(".", 1)[1] for n, _ in split.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())
    params = dict(whole.named_parameters())
    assert all(torch.equal(p, params[n.split(".", 1)[1]]) for n, p in split.named_parameters())
    for model in (split, whole):
        unused_model.set_step(model, c, 0, 0, 1)
    x = torch.randn(c.batch, c.hidden, requires_grad=c.input_grad)
    assert torch.equal(split(x), whole(x))


def test_a_drawn_model_runs_unsharded() -> None:
    c = unused.case_at(SEED, 3)
    model = unused_model.build(c)
    unused_model.set_step(model, c, 0, 0, 1)
    out = model(torch.randn(c.batch, c.hidden))
    assert out.shape == (c.batch, 2)
