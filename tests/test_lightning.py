"""Lightning on fullshard: Fabric's ``ModelParallelStrategy`` (FSDP2) at 2 gloo ranks, against torch's.

The user's ``parallelize_fn`` calls torch's ``fully_shard``; under ``fullshard.use_in_torch()``
that builds fullshard's units. ``fabric.no_backward_sync`` finds the units by
``isinstance(m, FSDPModule)`` and turns their gradient sync off for the accumulating steps.
Losses and parameters must equal torch's run bit for bit (fp32).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import TinyLM, tokens

import fullshard
from fullshard.engine.hooks import fsdp_state


def _parallelize(model: TinyLM, device_mesh: Any) -> TinyLM:
    from torch.distributed.fsdp import fully_shard  # torch's name, as a Lightning user writes it

    mesh = device_mesh["data_parallel"]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fabric_run(rank: int, world: int, on_fullshard: bool) -> tuple[list[float], list[torch.Tensor]]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")  # torchelastic's variables: no launching
    binding = fullshard.use_in_torch() if on_fullshard else None
    try:
        strategy = ModelParallelStrategy(_parallelize, data_parallel_size=world, tensor_parallel_size=1)
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup_module(TinyLM(layers=2))
        assert (fsdp_state(model.module.layers[0]) is not None) == on_fullshard
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        losses = []
        for step in range(4):  # two optimizer steps of two micro-batches
            accumulating = step % 2 == 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                if on_fullshard:
                    assert fsdp_state(model.module.layers[1]).unit.sync_grads is not accumulating
                loss = model(tokens(step, 2 * world)[2 * rank : 2 * rank + 2]).logsumexp(-1).mean()
                fabric.backward(loss)
            losses.append(loss.item())
            if not accumulating:
                opt.step()
                opt.zero_grad()
        return losses, [p.full_tensor() for p in model.parameters()]
    finally:
        if binding is not None:
            binding.undo()


def _fabric_both(rank: int, world: int) -> list[Any]:
    return [_fabric_run(rank, world, on_fullshard) for on_fullshard in (False, True)]


@pytest.mark.timeout(240)
def test_fabric_model_parallel_strategy_on_fullshard_matches_torch() -> None:
    pytest.importorskip("lightning")
    (ref_losses, ref_params), (losses, params) = run_ranks(_fabric_both, 2, timeout=220)[0]
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(ref_params, params))
