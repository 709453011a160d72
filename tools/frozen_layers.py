"""Frozen lower layers: rank 0's peak live tensor bytes (third step), its all-gathers per step and
the estimate, at 2 gloo ranks, FULL_SHARD per block: fullshard's FSDP1 wrapper, its ``fully_shard``
and torch's ``fully_shard`` (FSDP2) in the same run.

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
from typing import Any

import torch

from fullshard import probes
from fullshard.jobs import launch
from fullshard.jobs.planning import families
from fullshard.jobs.planning.families import Shape
from fullshard.plan.memory import peak_rss_bytes
from fullshard.plan.tracker import LiveTensorBytes

CASES = {
    "nothing frozen": (None, False),
    "tied trainable embedding, blocks 0-5 frozen": (True, False),
    "frozen untied embedding, blocks 0-5 frozen": (False, True),
}


def parts(tied: bool | None, frozen_embed: bool) -> tuple:
    """The model's parts (``families.parts``); ``tied=None``: tied, and nothing frozen."""
    shape = Shape(8, heads=8, kv_heads=8, head_dim=64, ffn=2048, vocab=1000, tied=tied is not False)
    make0, example, loss_fn, is_unit = families.parts("gpt", shape, 2, 64)

    def make() -> torch.nn.Module:
        m = make0()
        for name, p in m.named_parameters():
            lower = tied is not None and any(name.startswith(f"blocks.{i}.") for i in range(6))
            if lower or (frozen_embed and name == "embed.weight"):
                p.requires_grad_(False)
        return m

    return make, example, loss_fn, is_unit


IMPLEMENTATIONS = ("fullshard", "fullshard fully_shard", "torch FSDP2")


def wrap(model: torch.nn.Module, impl: str, precision: str, is_unit: Any) -> torch.nn.Module:
    """``model`` sharded per block by ``impl`` (one of :data:`IMPLEMENTATIONS`)."""
    if impl == "torch FSDP2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
        for m in [m for m in model.modules() if is_unit(m)]:
            fully_shard(m, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)  # type: ignore[return-value]
    from fullshard.frontend.wrap import lambda_auto_wrap_policy
    from fullshard.jobs.train import fsdp_options

    opts = types.SimpleNamespace(
        sharding_strategy="full_shard", mixed_precision=precision, cpu_offload=False, backward_prefetch="pre",
        forward_prefetch=False, api="fsdp1" if impl == "fullshard" else "fsdp2",
    )  # fmt: skip
    return fsdp_options.shard_model(model, opts, functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit))


def measure(tied: bool | None, frozen_embed: bool, precision: str, impl: str) -> tuple[int, int, int]:
    """Rank 0's peak live tensor bytes in the third step, its all-gathers in that step (-1 for
    torch's, which fullshard's probes do not see) and its peak RSS above the RSS before the model
    was built (bytes)."""
    make, example, loss_fn, is_unit = parts(tied, frozen_embed)
    rss = peak_rss_bytes()
    with LiveTensorBytes() as live:
        torch.manual_seed(0)
        model = wrap(make(), impl, precision, is_unit)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        for _ in range(3):
            batch = families.random_batch("gpt", example, 1000)
            live.reset_peak()
            with probes.enabled(events=True) as p:
                loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    gathers = sum(1 for event, _ in p.events or [] if event == "unshard")
    return live.peak, gathers if impl != "torch FSDP2" else -1, peak_rss_bytes() - rss


def _worker(tied: bool | None, frozen_embed: bool, precision: str, impl: str) -> tuple[int, int, int]:
    launch.init_process_group()
    try:
        return measure(tied, frozen_embed, precision, impl)
    finally:
        launch.destroy_process_group()


def main() -> None:
    from fullshard.plan.peak import estimate_peak

    print(
        "| case | precision | implementation | estimate (MiB) | measured peak, rank 0 (MiB) | all-gathers a step "
        "| peak RSS above the start, rank 0 (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    mib = 2**20
    for label, (tied, frozen_embed) in CASES.items():
        for precision in ("none", "bf16"):
            make, example, loss_fn, is_unit = parts(tied, frozen_embed)
            dtype = torch.bfloat16 if precision == "bf16" else None
            for impl in IMPLEMENTATIONS:
                front = "fully_shard" if impl != "fullshard" else "wrapper"
                e = estimate_peak(make, example, loss_fn, is_unit, 2, param_dtype=dtype, front_end=front)
                peak, gathers, rss = launch.launch(_worker, (tied, frozen_embed, precision, impl), 2)[0]
                shown = "-" if gathers < 0 else str(gathers)
                predicted = f"{e.total / mib:.2f}" if impl != "torch FSDP2" else "-"
                print(
                    f"| {label} | {precision} | {impl} | {predicted} | {peak / mib:.2f} | {shown} | {rss / mib:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
