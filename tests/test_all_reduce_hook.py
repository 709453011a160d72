"""``FSDPModule.set_all_reduce_hook`` against torch's own ``fully_shard`` at 2 ranks.

A hook on every block's unit and on the root's (set one module at a time, as torch's applies
it) scales each reduced gradient shard, counts its calls and records the shard's shape; an
identical model sharded by torch's ``fully_shard`` gets the same hooks. Three AdamW steps, the
second accumulating a micro-batch with gradient sync off first (no hook call for it): losses,
parameters, call counts and shapes equal torch's bit for bit (scaling by 0.5 commutes with
where each divides by the world size). A stream on a 1-D mesh is ignored with a warning.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import TinyLM, accumulating_steps


class Recorder:
    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, reduced: torch.Tensor) -> None:
        self.shapes.append(tuple(reduced.shape))
        reduced.mul_(0.5)


def _run(fully_shard, base: torch.nn.Module, rank: int, world: int) -> tuple[list[float], dict, list]:
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    recorders = []
    for module in [*model.layers, model]:
        recorders.append(Recorder())
        module.set_all_reduce_hook(recorders[-1])
    losses, full = accumulating_steps(model, rank)
    return losses, full, [r.shapes for r in recorders]


def hook_body(rank: int, world: int) -> list[str]:
    import torch.distributed.fsdp as torch_fsdp

    import fullshard

    torch.manual_seed(0)
    base = TinyLM(layers=2)
    theirs = _run(torch_fsdp.fully_shard, base, rank, world)
    ours = _run(fullshard.fully_shard, base, rank, world)
    assert ours[0] == theirs[0], (ours[0], theirs[0])
    for n, v in theirs[1].items():
        assert torch.equal(ours[1][n], v), n
    assert ours[2] == theirs[2] and all(len(s) == 3 for s in ours[2]), (ours[2], theirs[2])
    model = fullshard.fully_shard(TinyLM(layers=1))
    with pytest.warns(UserWarning, match="stream"):
        model.set_all_reduce_hook(Recorder(), stream=object())
    return ["hook"]


@pytest.mark.timeout(200)
def test_all_reduce_hook_like_torch() -> None:
    assert run_ranks(hook_body, 2, timeout=180)[0] == ["hook"]
