"""A user's own training function under Ray Train, sharded by fullshard.

Ray Train starts the workers and creates the process group (gloo on CPU, NCCL on GPUs); the
training function wraps its model with fullshard (``fully_shard``, or the FSDP1 wrapper with
``--api fsdp1``) instead of Ray's ``prepare_model`` (which wraps in torch's FSDP1 and needs
GPUs), saves fullshard's sharded checkpoint into a ``ray.train.Checkpoint`` after every epoch
(each worker its own shards, in its own temporary directory; Ray merges them), and resumes from
``ray.train.get_checkpoint()`` after a failure or when the run is started again.

    pip install 'fullshard[ray]'
    python examples/ray_train_fsdp.py --num-workers 2 --epochs 4 --storage-path /tmp/ray-fsdp

The last line printed is JSON: the loss of every epoch and the final checkpoint's path.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, SAMPLES_PER_WORKER, BATCH = 32, 128, 512, 64


class Block(nn.Module):
    """One residual MLP block: (batch, FEATURES) -> (batch, FEATURES); becomes one FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every worker
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(FEATURES, 1))


def worker_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's share of a fixed regression problem: x (N, FEATURES) float32, y (N, 1)."""
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(FEATURES, 1, generator=teacher)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(SAMPLES_PER_WORKER, FEATURES, generator=g)
    return x, torch.tanh(x @ w / FEATURES**0.5)


def shard(model: nn.Sequential, api: str) -> nn.Module:
    """One FSDP unit per Block and the root: fully_shard (DTensor parameters) or the wrapper."""
    if api == "fsdp2":
        from fullshard import fully_shard

        for block in model[:-1]:
            fully_shard(block)
        return fully_shard(model)
    from fullshard import FullyShardedDataParallel
    from fullshard.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))


def train_func(config: dict) -> None:
    """Runs on every Ray Train worker; the process group exists already."""
    import ray.train
    import torch.distributed as dist

    from fullshard import checkpoint

    context = ray.train.get_context()
    rank = context.get_world_rank()
    model = shard(make_model(), config["api"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first_epoch = 0
    resume_from = ray.train.get_checkpoint()
    if resume_from is not None:  # a restart: continue where the last reported checkpoint left off
        with resume_from.as_directory() as directory:
            first_epoch = checkpoint.load(directory, model, optimizer)["epoch"] + 1
        if rank == 0:  # the checkpoint reshards when the number of workers changed
            print(f"resumed at epoch {first_epoch} on {context.get_world_size()} workers", flush=True)
    x, y = worker_data(rank)
    for epoch in range(first_epoch, config["epochs"]):
        total = torch.zeros(2)
        for i in range(0, len(x), BATCH):
            loss = F.mse_loss(model(x[i : i + BATCH]), y[i : i + BATCH])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item(), 1.0])
        dist.all_reduce(total)  # mean loss over all workers' batches
        metrics = {"epoch": epoch, "loss": (total[0] / total[1]).item()}
        with tempfile.TemporaryDirectory() as tmp:  # each worker its own; Ray merges them
            saved = checkpoint.save(tmp, epoch, model, optimizer, extra={"epoch": epoch})
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(saved)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--api", choices=("fsdp2", "fsdp1"), default="fsdp2")
    p.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "ray-fsdp"))
    p.add_argument("--max-failures", type=int, default=1)
    p.add_argument("--use-gpu", action="store_true")
    args = p.parse_args()

    import ray.train
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "api": args.api},
        scaling_config=ray.train.ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=ray.train.RunConfig(
            name=f"fullshard-example-{args.api}",
            storage_path=os.path.abspath(args.storage_path),
            failure_config=ray.train.FailureConfig(max_failures=args.max_failures),
        ),
    )
    losses = []
    result = trainer.fit()
    for _, metrics in result.best_checkpoints:
        losses.append(metrics["loss"])
    print(json.dumps({"losses": losses, "checkpoint": result.checkpoint.path}))


if __name__ == "__main__":
    main()
