"""Can NCCL put two ranks on one GPU? (issue 33's quantized runs need world size >= 2 on CUDA.)

    torchrun --standalone --nproc-per-node 2 tools/nccl_one_gpu.py

Both ranks use ``cuda:0`` and all-gather 1 Mi float32 elements; prints the result or NCCL's
error (NCCL refuses duplicate GPUs in one communicator in the versions we know of).
"""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
try:
    x = torch.full((1 << 20,), float(rank), device="cuda")
    out = torch.empty(2 << 20, device="cuda")
    dist.all_gather_into_tensor(out, x)
    torch.cuda.synchronize()
    print(f"rank {rank}: all-gather on one GPU ok, sum {out.sum().item():.0f}", flush=True)
finally:
    dist.destroy_process_group()
