"""A reentrant checkpoint on a child module inside an FSDP unit (``torch.utils.checkpoint(...,
use_reentrant=True)`` called in the unit's forward, or torch's ``checkpoint_wrapper`` with
``CheckpointImpl.REENTRANT`` applied before wrapping). The child's recomputation runs its own
backward (its own autograd graph task) in the middle of the unit's backward, and that nested
backward accumulates the child's gradients into the unit's full flat gradient, which fires the
unit's gradient-ready hook before the rest of the unit's backward has run. The post-backward
that hook ran used to reduce-scatter and reshard there, and the outer backward then failed:
"backward needs a tensor saved from the unit's full parameters" at step 0 (found by review on
2026-11-29). Torch's ``fully_shard`` runs the same model.
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
    checkpoint when ``call`` (else plain: ``checkpoint_wrapper`` put around them)."""

    def __init__(self, call: bool, two: bool) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.d = nn.Linear(6, 6) if two else None
        self.call = call

    def _run(self, m: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return cp.checkpoint(m, h, use_reentrant=True) if self.call else m(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self._run(self.b, torch.tanh(self.a(x))))
        if self.d is not None:
            h = torch.tanh(self._run(self.d, h))
        return self.c(h)


class Net(nn.Module):
    def __init__(self, call: bool, two: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(call, two) for _ in range(3)])
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
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
    ref = Net(how == "call", two)
    if how == "wrapper":
        for block in ref.blocks:
            block.b = checkpoint_wrapper(block.b, checkpoint_impl=CheckpointImpl.REENTRANT)
            if two:
                block.d = checkpoint_wrapper(block.d, checkpoint_impl=CheckpointImpl.REENTRANT)
    model = copy.deepcopy(ref)
    if front == "fsdp1":
        return ref, FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    shard = fullshard.fully_shard if front == "fully_shard" else torch_fsdp.fully_shard
    for block in model.blocks:
        shard(block)
    shard(model)
    return ref, model


def body(rank: int, world: int, how: str, two: bool) -> dict[str, list]:
    """Per front end: three SGD steps; each step's loss, and for fullshard's fronts the
    reduce-scatters per unit and whether every parameter's gradient is the unsharded model's
    averaged (checked before the step), and every unit sharded and idle after backward."""
    from fullshard import probes
    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import ShardState, TrainingState

    out: dict[str, list] = {}
    for front in ("fully_shard", "fsdp1", "torch"):
        ref, model = _build(front, how, two)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
        losses, reduces = [], []
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            with probes.enabled(events=True) as p:
                loss = model(x).square().mean()
                loss.backward()
            losses.append(round(loss.item(), 6))
            if front != "torch":
                reduces.append(sum(e == "reduce" for e, _ in p.events or []))
                units = [s.unit for m in model.modules() if (s := fsdp_state(m)) is not None]
                assert all(u.shard_state is ShardState.SHARDED for u in units), (front, step)
                assert all(u.training_state is TrainingState.IDLE for u in units), (front, step)
                ref(x).square().mean().backward()
                _assert_averaged(ref, model, world, front, front == "fsdp1")
            for opt in opts:
                opt.step()
                opt.zero_grad()
        out[front] = [losses, reduces]
    return out


def _assert_averaged(ref: nn.Module, model: nn.Module, world: int, what: str, plain: bool) -> None:
    """Each sharded gradient is the unsharded model's averaged over ranks (``ref``'s ``.grad``)."""
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


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("how", "two", "world"), [("call", False, 2), ("wrapper", True, 2), ("call", True, 3)])
def test_a_reentrant_checkpoint_inside_a_unit_matches_torch(how: str, two: bool, world: int) -> None:
    got = run_ranks(body, world, how, two, timeout=180)
    for rank_got in got:
        assert rank_got["fully_shard"][0] == pytest.approx(rank_got["torch"][0], rel=1e-5)
        assert rank_got["fsdp1"][0] == pytest.approx(rank_got["torch"][0], rel=1e-5)
        # One reduce-scatter per unit per step (3 blocks and the root), as without the checkpoint.
        assert rank_got["fully_shard"][1] == [4, 4, 4]
        assert rank_got["fsdp1"][1] == [4, 4, 4]
