"""The FSDP1 wrapper in 20 lines: a size-based auto-wrap policy picks the FSDP units.

    torchrun --standalone --nproc-per-node 2 examples/fsdp1_quickstart.py

The code below is README.md's FSDP1 example; each rank prints its last loss and how many
tensors its full state dict holds.
"""

import functools

import torch
import torch.distributed as dist
from torch import nn

from fullshard import FullyShardedDataParallel as FSDP  # was: torch.distributed.fsdp
from fullshard import ShardingStrategy
from fullshard.wrap import size_based_auto_wrap_policy

dist.init_process_group("gloo")  # "nccl" on GPUs; torchrun gives the rank and world size
torch.manual_seed(0)  # the same initial weights on every rank
blocks = [nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)]
model = FSDP(
    nn.Sequential(*blocks, nn.Linear(256, 10)),
    sharding_strategy=ShardingStrategy.FULL_SHARD,
    auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=50_000),
)  # each Linear(256, 256) is an FSDP unit; the last Linear stays in the root unit
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # sees only this rank's shards
data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
for step in range(5):
    x, y = torch.randn(32, 256, generator=data), torch.randint(0, 10, (32,), generator=data)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()  # gradients reduce-scattered and averaged over the ranks
    optimizer.step()
    optimizer.zero_grad()
full = model.state_dict()  # full tensors under the original names (a collective)
print(f"rank {dist.get_rank()}: last loss {loss.item():.4f}, full state dict of {len(full)} tensors")
dist.destroy_process_group()
