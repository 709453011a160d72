"""Frozen lower layers: rank 0's peak live tensor bytes (third step), its all-gathers per step and
the estimate, at 2 gloo ranks, FULL_SHARD per block, the FSDP1 wrapper.

The sweep's "gpt" family (8 blocks, d 512, ffn 2048, vocab 1000; 2 x 64 tokens a rank: a
fine-tuning step, where parameters outweigh activations), its lower six blocks frozen, either under
a trainable tied embedding (the frozen blocks run backward for the embedding's gradient) or under
a frozen untied embedding (they never run backward). Run it with one tree's ``src`` on
PYTHONPATH, then another's, to compare engines:

    PYTHONPATH=src python tools/frozen_layers.py
"""

from __future__ import annotations

import functools
import types

import torch

from fullshard import probes
from fullshard.jobs import launch
from fullshard.jobs.planning import families
from fullshard.jobs.planning.families import Shape
from fullshard.plan.tracker import LiveTensorBytes

CASES = {
    "tied trainable embedding, blocks 0-5 frozen": (True, False),
    "frozen untied embedding, blocks 0-5 frozen": (False, True),
}


def parts(tied: bool, frozen_embed: bool) -> tuple:
    shape = Shape(8, heads=8, kv_heads=8, head_dim=64, ffn=2048, vocab=1000, tied=tied)
    make0, example, loss_fn, is_unit = families.parts("gpt", shape, 2, 64)

    def make() -> torch.nn.Module:
        m = make0()
        for name, p in m.named_parameters():
            if any(name.startswith(f"blocks.{i}.") for i in range(6)) or (frozen_embed and name == "embed.weight"):
                p.requires_grad_(False)
        return m

    return make, example, loss_fn, is_unit


def measure(tied: bool, frozen_embed: bool, precision: str) -> tuple[int, int]:
    from fullshard.frontend.wrap import lambda_auto_wrap_policy
    from fullshard.jobs.train import fsdp_options

    make, example, loss_fn, is_unit = parts(tied, frozen_embed)
    opts = types.SimpleNamespace(
        sharding_strategy="full_shard", mixed_precision=precision, cpu_offload=False, backward_prefetch="pre",
        forward_prefetch=False, api="fsdp1",
    )  # fmt: skip
    with LiveTensorBytes() as live:
        torch.manual_seed(0)
        model = fsdp_options.shard_model(make(), opts, functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        for _ in range(3):
            batch = families.random_batch("gpt", example, 1000)
            live.reset_peak()
            with probes.enabled(events=True) as p:
                loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return live.peak, sum(1 for event, _ in p.events or [] if event == "unshard")


def _worker(tied: bool, frozen_embed: bool, precision: str) -> tuple[int, int]:
    launch.init_process_group()
    try:
        return measure(tied, frozen_embed, precision)
    finally:
        launch.destroy_process_group()


def main() -> None:
    from fullshard.plan.peak import estimate_peak

    print("| case | precision | estimate (MiB) | measured peak, rank 0 (MiB) | all-gathers a step |")
    print("|---|---|---|---|---|")
    for label, (tied, frozen_embed) in CASES.items():
        for precision in ("none", "bf16"):
            make, example, loss_fn, is_unit = parts(tied, frozen_embed)
            dtype = torch.bfloat16 if precision == "bf16" else None
            e = estimate_peak(make, example, loss_fn, is_unit, 2, param_dtype=dtype, front_end="wrapper")
            peak, gathers = launch.launch(_worker, (tied, frozen_embed, precision), 2)[0]
            mib = 2**20
            print(f"| {label} | {precision} | {e.total / mib:.2f} | {peak / mib:.2f} | {gathers} |", flush=True)


if __name__ == "__main__":
    main()
