"""fullshard's gathers on CUDA tensors at two ranks on one GPU, over gloo (NCCL refuses two ranks
on one GPU; see tools/nccl_one_gpu.py).

    torchrun --standalone --nproc-per-node 2 tools/gloo_cuda_two_ranks.py

Both ranks put their model on ``cuda:0`` (the CPU without CUDA) and use a gloo process group. A
stack of Linear layers, one FSDP unit each, trains 3 steps with bf16 mixed precision: the shards
are float32, so each all-gather casts this rank's shards into its own slot of the gathered
buffer on the GPU (``Unit._gather_into``). Prints per rank whether the summoned parameters equal
the originals, whether the first unit's gathered weight is the float32 one cast to bf16, and
whether training stayed finite with both ranks agreeing; or gloo's error if it refuses CUDA
tensors.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

rank = int(os.environ["RANK"])
device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("gloo")
try:
    from fullshard import FSDP, MixedPrecision
    from fullshard.frontend.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(96, 96) for _ in range(4))).to(device)
    full = [p.detach().clone() for p in model.parameters()]
    wrapped = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    )
    with FSDP.summon_full_params(wrapped):
        gathered = [p.detach().clone() for p in wrapped.parameters()]
    same = all(torch.equal(g.float(), f) for g, f in zip(gathered, full))
    print(f"rank {rank}: summoned parameters equal the originals: {same}", flush=True)
    seen: list[torch.Tensor] = []
    first = wrapped.module[0].module  # the Linear inside the first unit
    hook = first.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(8, 96, device=device, generator=torch.Generator(device).manual_seed(step * 2 + rank))
        loss = wrapped(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    hook.remove()
    cast = seen[0].dtype == torch.bfloat16 and torch.equal(seen[0], full[0].to(torch.bfloat16))
    print(f"rank {rank}: first gathered weight is the float32 one cast to bf16: {cast}", flush=True)
    with FSDP.summon_full_params(wrapped):
        flat = torch.cat([p.detach().float().flatten() for p in wrapped.parameters()])
    others = [torch.empty_like(flat.cpu()) for _ in range(2)]
    dist.all_gather(others, flat.cpu())
    print(
        f"rank {rank}: loss {loss.item():.6f} finite {bool(torch.isfinite(flat).all())}, "
        f"ranks agree {torch.equal(others[0], others[1])}",
        flush=True,
    )
finally:
    dist.destroy_process_group()
