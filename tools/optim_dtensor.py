"""How much the optimizer step costs on fully_shard's DTensor parameters against the wrapper's
plain shards: the bench's compute-bound GPT at 2 gloo ranks, AdamW (torch's CPU default: one
tensor at a time), the median of 20 steps' ``optimizer.step()`` alone, the two taking turns step by step.

Run: ``python tools/optim_dtensor.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import statistics
import time

import torch

from fullshard.jobs import launch


def worker() -> list[tuple[str, float, int]] | None:
    from fullshard import FSDP, fully_shard
    from fullshard.comm import collectives
    from fullshard.jobs.models.gpt import GPT, Block, GPTConfig

    launch.init_process_group()
    torch.set_num_threads(1)
    jobs = []
    for name in ("FSDP1 wrapper (plain shards)", "fully_shard (DTensor shards)"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=128))
        if name.startswith("FSDP1"):
            model = FSDP(
                model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, Block)
            )
        else:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        jobs.append((name, model, torch.optim.AdamW(model.parameters(), lr=1e-3), []))
    x = torch.randint(0, 256, (8, 128))
    for step in range(25):  # interleaved, so drift in the machine's speed hits both alike
        for _, model, opt, times in jobs:
            opt.zero_grad()
            model(x).float().sum().backward()
            collectives.barrier(collectives.default_group())
            start = time.perf_counter()
            opt.step()
            if step >= 5:
                times.append(time.perf_counter() - start)
    rows = [(name, statistics.median(times), sum(1 for _ in model.parameters())) for name, model, _, times in jobs]
    rank = collectives.group_rank(collectives.default_group())
    launch.destroy_process_group()
    return rows if rank == 0 else None


if __name__ == "__main__":
    rows = launch.launch(worker, (), 2)[0]
    assert rows is not None
    print("| parameters | tensors | AdamW step (ms) | vs plain |")
    print("|---|---|---|---|")
    for name, seconds, count in rows:
        print(f"| {name} | {count} | {seconds * 1e3:.2f} | {seconds / rows[0][1]:.2f}x |")
