"""FSDP2's ``fully_shard`` in 20 lines: one unit per block, then the root.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_quickstart.py

The code below is README.md's FSDP2 example; each rank prints its last loss and how many
tensors its full state dict holds.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fullshard import MixedPrecisionPolicy, fully_shard  # was: torch.distributed.fsdp

dist.init_process_group("gloo")  # "nccl" on GPUs; torchrun gives the rank and world size
torch.manual_seed(0)  # the same initial weights on every rank
blocks = [nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)]
model = nn.Sequential(*blocks, nn.Linear(256, 10))
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in blocks:
    fully_shard(block, mp_policy=mp)  # one FSDP unit per block
fully_shard(model, mp_policy=mp)  # the root unit: the last Linear; model is now an FSDPModule
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # DTensor parameters and state
data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
for step in range(5):
    x, y = torch.randn(32, 256, generator=data), torch.randint(0, 10, (32,), generator=data)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()  # gradients reduce-scattered in float32 and averaged
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm, on every rank
    optimizer.step()
    optimizer.zero_grad()
options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only
full = get_model_state_dict(model, options=options)  # a collective
print(f"rank {dist.get_rank()}: last loss {loss.item():.4f}, full state dict of {len(full)} tensors")
dist.destroy_process_group()
