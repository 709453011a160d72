"""A reentrant checkpoint on a child module inside an FSDP unit (``torch.utils.checkpoint(...,
use_reentrant=True)`` called in the unit's forward, or torch's ``checkpoint_wrapper`` with
``CheckpointImpl.REENTRANT`` applied before wrapping). The child's recomputation runs its own
backward (its own autograd graph task) in the middle of the unit's backward, and that nested
backward accumulates the child's gradients into the unit's full flat gradient, which fires the
unit's gradient-ready hook before the rest of the unit's backward has run. The post-backward
that hook ran used to reduce-scatter and reshard there, and the outer backward then failed:
"backward needs a tensor saved from the unit's full parameters" at step 0 (found by review on
2026-11-29). The post-backward now waits (engine.nested_grad) for the rest of the unit's
backward, or for backward's end where the unit's parameters are used in segments alone; not for
a graph no backward runs (a kept evaluation's: waiting for it on one rank diverged the
collectives in review). Torch's ``fully_shard`` runs the same models.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as cp
from dist import run_ranks
from torch import nn


class Block(nn.Module):
    """``c(tanh(b(tanh(a(x)))))`` with ``b`` (and with ``two``, then ``d``) under a reentrant
    checkpoint when ``call`` (else plain: ``checkpoint_wrapper`` put around them). ``only``: no
    ``a`` and ``c``, the unit's parameters used inside its two segments alone (its own split
    node's backward never runs: its gradient comes from two nested backwards)."""

    def __init__(self, call: bool, two: bool, only: bool = False) -> None:
        super().__init__()
        self.a, self.c = (nn.Identity(), nn.Identity()) if only else (nn.Linear(6, 6), nn.Linear(6, 6))
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.d = nn.Linear(6, 6) if two or only else None
        self.call, self.whole_body = call, False
        self.hf = False  # the Net checkpoints this whole unit from outside, HF's way

    def _run(self, m: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return cp.checkpoint(m, h, use_reentrant=True) if self.call else m(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole_body:  # one segment, torch's checkpoint_wrapper(block, REENTRANT) inside the unit
            return cp.checkpoint(self._body, x, use_reentrant=True)
        return self._body(x)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self._run(self.b, torch.tanh(self.a(x))))
        if self.d is not None:
            h = torch.tanh(self._run(self.d, h))
        return self.c(h)


class Net(nn.Module):
    def __init__(self, call: bool, two: bool, only: bool = False, whole: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)  # the first block's input requires grad, as a reentrant checkpoint needs
        self.blocks = nn.ModuleList([Block(call, two, only) for _ in range(3)])
        self.head = nn.Linear(6, 2)
        self.whole = whole  # each block (a whole unit) under a reentrant checkpoint, in training
        self.mids: nn.ModuleList | None = None  # the root's own, each after a block in a segment

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            hf = self.whole or block.hf  # the whole unit in a segment, HF's way
            x = cp.checkpoint(block, x, use_reentrant=True) if hf and self.training else block(x)
            if self.mids is not None:
                x = torch.tanh(cp.checkpoint(self.mids[i], x, use_reentrant=True))
        return self.head(x)


def _build(front: str, how: str, two: bool) -> tuple[nn.Module, nn.Module]:
    """The unsharded model and its sharded copy (``front``: fullshard's ``fully_shard``, its
    FSDP1 wrapper, or torch's ``fully_shard``), blocks as units."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    import fullshard
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = Net(how in ("call", "only"), two, how == "only", how == "whole")
    if how == "wrapper":
        for block in ref.blocks:
            block.b = checkpoint_wrapper(block.b, checkpoint_impl=CheckpointImpl.REENTRANT)
            if two:
                block.d = checkpoint_wrapper(block.d, checkpoint_impl=CheckpointImpl.REENTRANT)
    for block in ref.blocks:
        block.whole_body = how == "body"
    if how == "root":
        ref.mids = nn.ModuleList([nn.Linear(6, 6) for _ in ref.blocks])
    if how == "mix":
        ref.blocks[1].hf = True
    model = copy.deepcopy(ref)
    if front == "fsdp1" and how == "root":
        model.inp, model.head = FSDP(model.inp), FSDP(model.head)
    if front == "fsdp1":
        return ref, FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    shard = fullshard.fully_shard if front == "fully_shard" else torch_fsdp.fully_shard
    for block in model.blocks:
        shard(block)
    if how == "root":  # the root's parameters: its mids alone, each run in a segment of its own
        shard(model.inp)
        shard(model.head)
    shard(model)
    return ref, model


def _backward(model: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    """Forward and backward of one step (``retain``: a second backward through the graph the
    first kept; ``two``: two forwards, then one backward of their losses' sum, as a contrastive
    loss over two views); returns the loss."""
    out = model(x)
    loss = out.square().mean()
    if mode == "two":
        loss = loss + model(x * 0.5 + 1.0).square().mean()
    if mode == "retain":
        loss.backward(retain_graph=True)
        out.sum().backward()
    else:
        loss.backward()
    return loss


def body(rank: int, world: int, how: str, two: bool, mode: str = "plain") -> dict[str, list]:
    """Per front end: three SGD steps; each step's loss, and for fullshard's fronts the
    reduce-scatters and the peak number of units gathered per step, and whether every
    parameter's gradient is the unsharded model's averaged (checked before the step), and every
    unit sharded and idle after backward. With
    ``mode`` "kept", a forward with grad before each step whose output rank 0 keeps and never
    runs backward on (an evaluation logged later): its graph is not one a backward waits for."""
    from fullshard import probes
    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import ShardState, TrainingState

    out: dict[str, list] = {}
    for front in ("fully_shard", "fsdp1", "torch"):
        ref, model = _build(front, how, two)
        if how in ("rank0", "mix"):  # only rank 0 checkpoints (e.g. where its sequences are longer)
            for m in (*ref.modules(), *model.modules()):
                if isinstance(m, Block) and not m.hf:
                    m.whole_body = rank == 0
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
        losses, reduces, peaks, kept = [], [], [], []
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            if mode == "kept":  # run on every rank (its all-gathers), kept on rank 0 alone
                model.eval()
                evaluated = model(x * 2.0)
                model.train()
                kept += [evaluated] if rank == 0 else []
                del evaluated  # the other ranks' graph is freed here
            with probes.enabled(events=True) as p:
                loss = _backward(model, x, mode)
            losses.append(round(loss.item(), 6))
            if front != "torch":
                reduces.append(sum(e == "reduce" for e, _ in p.events or []))
                peaks.append(p.gathered.peak)
                units = [s.unit for m in model.modules() if (s := fsdp_state(m)) is not None]
                assert all(u.shard_state is ShardState.SHARDED for u in units), (front, step)
                assert all(u.training_state is TrainingState.IDLE for u in units), (front, step)
                _backward(ref, x, mode)
                _assert_averaged(ref, model, world, front, front == "fsdp1")
            for opt in opts:
                opt.step()
                opt.zero_grad()
        out[front] = [losses, reduces, peaks]
    return out


def _assert_averaged(ref: nn.Module, model: nn.Module, world: int, what: str, plain: bool) -> None:
    """Each sharded gradient is the unsharded model's averaged over ranks (``ref``'s ``.grad``,
    which becomes that average: both models take the same step)."""
    import torch.distributed as dist

    from fullshard import FSDP

    if plain:
        with FSDP.summon_full_params(model, with_grads=True):
            got = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    else:
        got = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")  # FSDP1's names leave the wrapper out, as torch's
        want = p.grad.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(got[name], want / world, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")
        p.grad = want / world


# (how, two, world, mode, reduce-scatters per step): one per unit (3 blocks and the root) where
# the unit's own split node is still to come after a segment's gradient (its post-backward waits
# for it); one per segment and unit where the unit's parameters are used in segments alone.
CASES = [
    ("call", False, 2, "plain", 4),
    ("wrapper", True, 2, "plain", 4),
    ("call", True, 3, "plain", 4),
    ("only", True, 2, "plain", 7),  # two segments per block, used in them alone: held gathered between
    # a retained graph's second backward: the split nodes ran in the first, so not waited for (4 + 10)
    ("call", True, 2, "retain", 14),
    # rank 0's kept graph: waiting for it diverged the ranks' collectives (whole, fully_shard), and
    # so did FSDP1's root reusing its gather where a graph awaited backward (both, engine.gather_reuse)
    ("call", False, 2, "kept", 4),
    ("whole", False, 2, "kept", 4),
    # A unit's whole body one segment: its gradient from the nested backward alone; it reshards at
    # the next unit's hook (3abe5ff kept every unit gathered to backward's end).
    ("body", False, 2, "plain", 4),
    ("rank0", False, 2, "plain", 4),  # rank 0 alone checkpoints each body: one collective order still
    # ... beside a unit checkpointed whole on every rank, units of one size: 1f2c1f2 released the
    # waiting unit at the next one's pre-backward, after that unit's recomputation had
    # all-gathered, on rank 0 only: all-gathers and reduce-scatters paired crosswise, wrong gradients
    ("mix", False, 2, "plain", 4),
    # The root's own blocks, each in a segment, between its units (inp and head units too): the
    # root stays gathered to backward's end (a unit's hooks between its segments released it
    # early on 7b4eae7: seed 770001 case 23); three reduce-scatters of the root.
    ("root", False, 2, "plain", 8),
    # Two forwards before one backward: each block's segment of the first forward recomputes
    # after its post-backward for the second's ("cannot run forward in training state
    # POST_BACKWARD", or a recomputation on the shards, before 2026-11-29): gathered again, it
    # reduce-scatters once per segment (the root once).
    ("whole", False, 2, "two", 7),
    ("call", False, 2, "two", 4),
    ("body", False, 2, "two", 7),
    ("only", True, 2, "two", 13),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("how", "two", "world", "mode", "per_step"), CASES)
def test_a_reentrant_checkpoint_inside_a_unit_matches_torch(
    how: str, two: bool, world: int, mode: str, per_step: int
) -> None:
    got = run_ranks(body, world, how, two, mode, timeout=180)
    # With two forwards, torch's fully_shard leaves each block checkpointed whole unsharded after
    # backward (its full parameters registered), and its next forward reads them, stale after the
    # optimizer step: its losses part from the unsharded model's from step 1 on (fullshard's
    # gradients are checked against that model's at every step).
    steps = 1 if mode == "two" else 3
    for rank_got in got:
        assert rank_got["fully_shard"][0][:steps] == pytest.approx(rank_got["torch"][0][:steps], rel=1e-5)
        assert rank_got["fsdp1"][0][:steps] == pytest.approx(rank_got["torch"][0][:steps], rel=1e-5)
        assert rank_got["fully_shard"][1] == [per_step] * 3
        assert rank_got["fsdp1"][1] == [per_step] * 3
        # At most the root and two blocks gathered at once (one in backward, the next prefetched);
        # a third block with two forwards, as without checkpoints.
        assert max(rank_got["fully_shard"][2] + rank_got["fsdp1"][2]) <= (4 if mode == "two" else 3), rank_got


def two_roots_body(rank: int, world: int) -> int:
    """``dec(enc(x))``, each root a Sequential of two blocks (units), the top module unwrapped;
    rank 0 alone runs ``enc``'s second and ``dec``'s first block body in a reentrant checkpoint.
    Two SGD steps; each sharded gradient is the unsharded model's averaged. Returns the steps."""
    import torch.distributed as dist

    import fullshard

    torch.manual_seed(0)
    ref = nn.ModuleDict({"enc": nn.Sequential(Block(False, False), Block(False, False))})
    ref["dec"] = nn.Sequential(Block(False, False), Block(False, False))
    ref["enc"][1].whole_body = ref["dec"][0].whole_body = rank == 0
    model = copy.deepcopy(ref)
    for root in (model["enc"], model["dec"]):
        for block in root:
            fullshard.fully_shard(block)
        fullshard.fully_shard(root)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank)).requires_grad_()
        for m in (model, ref):
            m["dec"](m["enc"](x)).square().mean().backward()
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        for name, p in ref.named_parameters():
            want = p.grad.clone()
            dist.all_reduce(want)
            torch.testing.assert_close(got[name], want / world, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            p.grad = want / world  # both models take the same step
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return 2


@pytest.mark.timeout(120)
def test_two_roots_with_a_unit_checkpointed_on_one_rank_only() -> None:
    # A child segment's gradient reduces at once, as without the checkpoint, on every rank. When
    # it waited for the next unit's hook (1f2c1f2), dec's unit waited past enc's collectives on
    # rank 0 alone: the ranks' collectives paired crosswise, wrong gradients (review, 2026-11-29).
    assert run_ranks(two_roots_body, 2, timeout=100) == [2, 2]


def hf_rank0_body(rank: int, world: int, front: str, reshard: bool | int) -> list[str]:
    """Every block checkpointed whole from outside (HF's ``gradient_checkpointing``, reentrant)
    on rank 0 alone; three SGD steps of ``front`` (fullshard's ``fully_shard`` with
    ``reshard_after_forward=reshard``, or its FSDP1 wrapper), each gradient checked against the
    unsharded model's averaged. Returns this rank's collectives, in order (step, kind, elements)."""
    from fullshard import FSDP, fully_shard
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = Net(False, False)
    for block in ref.blocks:
        block.hf = rank == 0
    model = copy.deepcopy(ref)
    if front == "fsdp1":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    else:
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model)
    return _three_steps(ref, model, rank, world, front == "fsdp1")


def _three_steps(
    ref: nn.Module, model: nn.Module, rank: int, world: int, plain: bool, peaks: list[int] | None = None
) -> list[str]:
    """Three SGD steps of ``model`` and the unsharded ``ref``, each sharded gradient checked
    against ``ref``'s averaged; this rank's collectives in order (step, kind, elements). Each
    step's peak of units gathered at once goes to ``peaks``."""
    from fullshard import probes

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    order = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        with probes.enabled(collective_log=True) as p:
            model(x).square().mean().backward()
        order += [f"{step} {c[0]} {c[2]}" for c in p.collectives.log]
        if peaks is not None:
            peaks.append(p.gathered.peak)
        ref(x).square().mean().backward()
        _assert_averaged(ref, model, world, f"step {step}", plain)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return order


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("front", "reshard"), [("fully_shard", True), ("fully_shard", False), ("fully_shard", 2), ("fsdp1", True)]
)
def test_whole_units_checkpointed_on_one_rank_only_keep_one_collective_order(front: str, reshard: bool | int) -> None:
    # A unit run without grad inside a forward with grad (reentrant checkpointing's first pass)
    # reshards as with grad, and backward prefetches it from the first step on, so the rank that
    # checkpoints and the rank that does not issue the same collectives. Before: from step 0 the
    # checkpointing rank prefetched nothing in backward (same-size all-gathers and reduce-scatters
    # paired crosswise: wrong gradients, no error), and with units kept after forward (the
    # wrapper's last unit, reshard_after_forward=False) it gathered them again in backward where
    # the other rank did not (review, 2026-11-29).
    orders = run_ranks(hf_rank0_body, 2, front, reshard, timeout=180)
    assert orders[0] == orders[1]


def nested_rank0_body(rank: int, world: int) -> list[str]:
    """Each block's child ``b`` a unit of its own inside the block's unit, run in a reentrant
    checkpoint on rank 0 alone, with the watchdog's divergence check on; three SGD steps, each
    gradient checked against the unsharded model's averaged. Returns this rank's collectives (op,
    elements)."""
    from fullshard import fully_shard
    from fullshard.comm import watchdog

    torch.manual_seed(0)
    ref = Net(rank == 0, False)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block.b)
        fully_shard(block)
    fully_shard(model)
    watchdog.enable_watchdog(timeout=60)
    try:
        return _three_steps(ref, model, rank, world, False)
    finally:
        watchdog.disable_watchdog()


@pytest.mark.timeout(200)
def test_a_nested_unit_checkpointed_on_one_rank_only_is_not_called_diverged() -> None:
    # Rank 0 all-gathers the nested unit in its recomputation's forward where rank 1 does so in
    # backward: the same unit's shards, the same collective. The divergence check compared the
    # phase too and stopped both ranks (CollectiveDiverged); it no longer does for a unit's
    # collectives (comm.divergence.same_exchange). Without the watchdog this ran on d805a51, and
    # aborted gloo on c148560 (review helper-105).
    orders = run_ranks(nested_rank0_body, 2, timeout=180)
    assert orders[0] == orders[1]


class PosBlock(nn.Module):
    """Takes ``(x, pos)``; returns ``(x', pos)``, ``pos`` itself (T5's blocks so return their
    ``position_bias``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, xp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, pos = xp
        return x + torch.tanh(self.a(x + pos)), pos


class PosNet(nn.Module):
    def __init__(self, through: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.pos = nn.Parameter(torch.randn(6))
        self.blocks = nn.ModuleList([PosBlock() for _ in range(3)])
        self.through = through  # each block's pos the one the block before returned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, pos = self.inp(x), self.pos * 1.0
        for block in self.blocks:
            x, out = block((x, pos))
            pos = out if self.through else pos
        return x


def pos_body(rank: int, world: int, front: str) -> list[list[str]]:
    """Per way of passing ``pos`` on (returned by each block, or the root's own): three SGD steps
    of ``front``, gradients checked; this rank's collectives and the peak of units gathered."""
    from fullshard import FSDP, fully_shard
    from fullshard.frontend.wrap import ModuleWrapPolicy

    out = []
    for through in (False, True):
        torch.manual_seed(0)
        ref = PosNet(through)
        model = copy.deepcopy(ref)
        if front == "fsdp1":
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({PosBlock}))
        else:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        peaks: list[int] = []
        order = _three_steps(ref, model, rank, world, front == "fsdp1", peaks)
        out.append([*order, f"peak {max(peaks)}"])
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("front", ["fully_shard", "fsdp1"])
def test_a_unit_returning_its_input_is_not_gathered_again_by_its_late_hook(front: str) -> None:
    # The pre-backward hook on a block's output ``pos`` (its input) runs when backward reaches
    # the node that made ``pos``, after every block's post-backward. 93178ca's reopen took it for
    # a second gradient to come: every block all-gathered again and stayed gathered to backward's
    # end (T5 per T5Block: 26 all-gathers a step where 20 do, 8 blocks gathered at once; review
    # helper-106). The same collectives and peak as where the root passes pos on itself.
    for own, through in run_ranks(pos_body, 2, front, timeout=100):
        assert through == own
        assert own[-1] in ("peak 2", "peak 3"), own[-1]


class HeadNet(nn.Module):
    """Linear blocks, then ``pre`` (an ``nn.Identity``, which returns its input itself, or
    nothing) and ``head``; ``pre`` and ``head`` one unit."""

    def __init__(self, identity: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])
        self.pre = nn.Identity() if identity else None
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x.requires_grad_())
        return self.head(self.pre(h) if self.pre is not None else h)


def member_body(rank: int, world: int) -> list[list[str]]:
    """With and without the identity member: three SGD steps, gradients checked; this rank's
    collectives and the peak of units gathered."""
    from fullshard import fully_shard

    out = []
    for identity in (False, True):
        torch.manual_seed(0)
        ref = HeadNet(identity)
        model = copy.deepcopy(ref)
        for block in model.blocks:
            fully_shard(block)
        fully_shard([model.pre, model.head] if identity else model.head)
        fully_shard(model)
        peaks: list[int] = []
        out.append([*_three_steps(ref, model, rank, world, False, peaks), f"peak {max(peaks)}"])
    return out


@pytest.mark.timeout(120)
def test_an_identity_member_of_a_unit_does_not_reopen_it() -> None:
    # The hook on the Identity's output (its input) is the first of its call and runs after the
    # unit's post-backward; e3ef2cc reopened the unit there: gathered again after its
    # reduce-scatter and held to backward's end (peak 3 -> 4; review helper-107). Only a unit
    # whose post-backward ran in a nested backward (a reentrant checkpoint's) reopens.
    for plain, member in run_ranks(member_body, 2, timeout=100):
        assert member == plain
