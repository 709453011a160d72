"""fullshard's gathers on CUDA tensors at two ranks on one GPU, over gloo (NCCL refuses two ranks
on one GPU; see tools/nccl_one_gpu.py).

    torchrun --standalone --nproc-per-node 2 tools/gloo_cuda_two_ranks.py

Both ranks put their model on ``cuda:0`` (the CPU without CUDA) and use a gloo process group. A
stack of Linear layers, one FSDP unit each, trains 3 steps with bf16 mixed precision: the shards
are float32, so each all-gather casts this rank's shards into its own slot of the gathered
buffer on the GPU (``Unit._gather_into``). Prints per rank whether the summoned parameters equal
the originals, whether the first unit's gathered weight is the float32 one cast to bf16, and
whether training stayed finite with both ranks agreeing; or gloo's error if it refuses CUDA
tensors. ``tests/test_gpu.py`` runs :func:`check` too.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn


def check(device: torch.device) -> dict[str, bool]:
    """On each rank of a started 2-rank gloo group: wrap, summon, train 3 steps on ``device``;
    returns which checks held (``summoned``, ``cast``, ``finite``, ``agree``)."""
    from fullshard import FSDP, MixedPrecision
    from fullshard.frontend.wrap import ModuleWrapPolicy

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(96, 96) for _ in range(4))).to(device)
    full = [p.detach().clone() for p in model.parameters()]
    wrapped = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    )
    with FSDP.summon_full_params(wrapped):
        summoned = all(torch.equal(p.detach().float(), f) for p, f in zip(wrapped.parameters(), full))
    seen: list[torch.Tensor] = []
    first = wrapped.module[0].module  # the Linear inside the first unit
    hook = first.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(8, 96, device=device, generator=torch.Generator(device).manual_seed(step * 2 + rank))
        wrapped(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    hook.remove()
    cast = seen[0].dtype == torch.bfloat16 and torch.equal(seen[0], full[0].to(torch.bfloat16))
    with FSDP.summon_full_params(wrapped):
        flat = torch.cat([p.detach().float().flatten() for p in wrapped.parameters()]).cpu()
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    return {
        "summoned": summoned,
        "cast": cast,
        "finite": bool(torch.isfinite(flat).all()),
        "agree": torch.equal(both[0], both[1]),
    }


def main() -> None:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    try:
        result = check(device)
        print(f"rank {os.environ['RANK']} on {device}: {result}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
