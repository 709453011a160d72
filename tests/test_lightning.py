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


def _trainer_run(rank: int, world: int, on_fullshard: bool, root: str) -> list[float]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lm = TinyLM(layers=2)
            self.losses: list[float] = []

        def configure_model(self) -> None:
            _parallelize(self.lm, self.device_mesh)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            if on_fullshard:
                assert fsdp_state(self.lm.layers[0]) is not None
            loss = self.lm(batch).logsumexp(-1).mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    binding = fullshard.use_in_torch() if on_fullshard else None
    try:
        module = Module()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        data = torch.utils.data.DataLoader(list(tokens(0, 12)), batch_size=2)  # Lightning adds the sampler
        trainer.fit(module, data)
        return module.losses
    finally:
        if binding is not None:
            binding.undo()


def _trainer_both(rank: int, world: int, root: str) -> list[list[float]]:
    return [_trainer_run(rank, world, on_fullshard, root) for on_fullshard in (False, True)]


@pytest.mark.timeout(240)
def test_lightning_trainer_model_parallel_strategy_on_fullshard_matches_torch(tmp_path: Any) -> None:
    pytest.importorskip("lightning")
    ref, ours = run_ranks(_trainer_both, 2, str(tmp_path), timeout=220)[0]
    assert ref == ours and len(ref) == 3


# ---------------------------------------------------------------------- FSDP1: FSDPStrategy resume
def _fsdp1_resume(rank: int, world: int, root: str, kind: str) -> tuple[list[float], list[float]]:
    """4 steps with a checkpoint after step 2, then a new Trainer resuming from it for steps 3-4."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy
    from models import TinyBlock
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class CPUFSDPStrategy(FSDPStrategy):  # Lightning refuses FSDPStrategy itself on CPU (a name check)
        pass

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lm = TinyLM(layers=2)
            self.losses: list[float] = []

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            assert isinstance(self.trainer.strategy.model, fullshard.FullyShardedDataParallel)
            loss = self.lm(batch).logsumexp(-1).mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def trainer(callbacks: list[Any]) -> pl.Trainer:
        strategy = CPUFSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({TinyBlock}), state_dict_type=kind)
        return pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=4,
            logger=False,
            enable_checkpointing=bool(callbacks),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    # Every sample is the same (the resumed run restarts the shuffled loader): steps differ only by the state.
    data = torch.utils.data.DataLoader([tokens(0, 1)[0]] * 16, batch_size=2)
    with fullshard.use_in_torch(fsdp1=True):
        saver = ModelCheckpoint(
            dirpath=os.path.join(root, kind), filename="{step}", every_n_train_steps=2, save_top_k=-1
        )
        straight = Module()
        trainer(callbacks=[saver]).fit(straight, data)
        resumed = Module()
        trainer(callbacks=[]).fit(resumed, data, ckpt_path=os.path.join(root, kind, "step=2.ckpt"))
    return straight.losses, resumed.losses


def _fsdp1_both(rank: int, world: int, root: str) -> list[Any]:
    return [_fsdp1_resume(rank, world, root, kind) for kind in ("full", "sharded")]


@pytest.mark.timeout(240)
def test_lightning_fsdp1_strategy_resumes_exactly_full_and_sharded(tmp_path: Any) -> None:
    """Lightning's FSDPStrategy on fullshard's FullyShardedDataParallel: the run resumed from the
    step-2 checkpoint (full: one file loaded lazily; sharded: torch.distributed.checkpoint with
    ShardedTensor optimizer state) continues exactly as the uninterrupted run."""
    pytest.importorskip("lightning")
    for straight, resumed in run_ranks(_fsdp1_both, 2, str(tmp_path), timeout=220)[0]:
        assert len(straight) == 4 and resumed == straight[2:]
