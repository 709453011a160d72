"""``FSDPModule.reset_iter_state`` after an exception aborted a forward or a backward.

A block raises in its forward, or a hook on its output raises in backward, once the units
before it (forward) or after it (backward) have gathered, prefetched and reduced; in two cases
a micro-batch with gradient sync off came first, so unsharded gradients were accumulated. After
``reset_iter_state`` on the root every unit is SHARDED and IDLE, and the next steps are bit for
bit those of a run that never had the aborted iteration (which are the unsharded model's, to
float32 rounding): what it accumulated is gone, as torch documents for its ``reset_iter_state``.

torch 2.13's own ``fully_shard`` matches that run bit for bit when the forward raised; when
backward raised, or a micro-batch had accumulated with sync off, its next step still carries
gradients of the lost iteration (those accumulated on the unsharded parameters, which its reset
does not clear), so it is compared only in the forward case.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from torch import nn

CASES = ("forward", "backward", "accumulate, then forward", "accumulate, then backward")


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise ValueError("backward failed")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = ""  # "forward" or "backward": raise there

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "forward":
            raise ValueError("forward failed")
        y = torch.tanh(self.lin(x))
        if self.fail == "backward" and y.requires_grad:
            y.register_hook(_raise)
        return y


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _train(model: nn.Module, case: str, rank: int, world: int, sharded: bool) -> tuple[list[float], nn.Module]:
    """A good step, the iteration ``case`` aborts (none for ``""`` or the unsharded model), two
    good steps: the losses (this rank's; the unsharded model's, their mean) and the model."""
    from fullshard.engine.hooks import fsdp_state
    from fullshard.engine.unit import ShardState, TrainingState

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(i: int) -> float:
        if sharded:
            loss = _loss(model, _batch(i, rank))
        else:  # the mean of the ranks' losses: what data parallelism descends
            loss = sum(_loss(model, _batch(i, r)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    losses = [step(0)]
    if case:
        if case.startswith("accumulate"):
            model.set_requires_gradient_sync(False)
            _loss(model, _batch(1, rank)).backward()
        model[1].fail = case.split()[-1]
        with pytest.raises(ValueError, match="failed"):
            _loss(model, _batch(2, rank)).backward()
        model[1].fail = ""
        with pytest.raises(RuntimeError, match="root"):
            model[1].reset_iter_state()
        model.reset_iter_state()
        for m in model.modules():
            if (state := fsdp_state(m)) is not None:  # fullshard's units
                assert (state.unit.shard_state, state.unit.training_state) == (ShardState.SHARDED, TrainingState.IDLE)
        opt.zero_grad()
        model.set_requires_gradient_sync(True)
    losses += [step(3), step(4)]
    return losses, model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def _sharded_run(fully_shard, base: nn.Module, case: str, rank: int, world: int) -> tuple[list[float], dict]:
    model = copy.deepcopy(base)
    for block in model[:3]:
        fully_shard(block)
    fully_shard(model)
    model[0].set_modules_to_forward_prefetch([model[1]])  # an all-gather in flight at the failure
    model[1].set_modules_to_forward_prefetch([model[2]])
    losses, model = _train(model, case, rank, world, sharded=True)
    return losses, _full(model)


def reset_body(rank: int, world: int) -> list[str]:
    import torch.distributed.fsdp as torch_fsdp

    import fullshard

    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block(), Block(), nn.Linear(8, 3))
    clean = _sharded_run(fullshard.fully_shard, base, "", rank, world)
    reference = _full(_train(copy.deepcopy(base), "", rank, world, sharded=False)[1])
    for n, value in clean[1].items():
        torch.testing.assert_close(value, reference[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    done = []
    for case in CASES:
        ours = _sharded_run(fullshard.fully_shard, base, case, rank, world)
        assert ours[0] == clean[0], (case, ours[0], clean[0])
        assert all(torch.equal(v, clean[1][n]) for n, v in ours[1].items()), case
        done.append(case)
    if hasattr(torch_fsdp.FSDPModule, "reset_iter_state"):  # torch 2.13: see the module docstring
        theirs = _sharded_run(torch_fsdp.fully_shard, base, "forward", rank, world)
        assert theirs[0] == clean[0], (theirs[0], clean[0])
        assert all(torch.equal(v, clean[1][n]) for n, v in theirs[1].items())
        done.append("torch's, forward")
    return done


@pytest.mark.timeout(200)
def test_reset_iter_state_discards_the_aborted_iteration_like_torch() -> None:
    done = run_ranks(reset_body, 2, timeout=180)[0]
    assert done[: len(CASES)] == list(CASES), done
