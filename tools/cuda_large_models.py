"""The NCCL estimate against one CUDA device's measured peaks on models larger than the sweep's
(which draws 1-90 MiB models): GPT-2 124M- and 350M-shaped models of the sweep's "gpt" family at
world size 1, predicted and measured in this process as ``fullshard bench estimate --sweep
--device cuda`` does, printed as that sweep's table rows; then, per run, the share of the
prediction the planner would need beside ``CUDA_SLACK`` to hold the allocator's peak.

Usage (on a GPU machine, in the repository root):  python tools/cuda_large_models.py [--device cpu]
(``--device cpu`` runs tiny shapes of the same list on gloo: a check of the script itself.)
"""

from __future__ import annotations

import argparse
import dataclasses

from fullshard.jobs.planning import sweep_device
from fullshard.jobs.planning.families import Shape
from fullshard.jobs.planning.sweep import Config
from fullshard.plan.margin import CUDA_MARGIN, CUDA_SLACK

GPT2_124M = Shape(layers=12, heads=12, kv_heads=12, head_dim=64, ffn=3072, vocab=50257)
GPT2_350M = Shape(layers=24, heads=16, kv_heads=16, head_dim=64, ffn=4096, vocab=50257)
TINY = Shape(layers=2, heads=2, kv_heads=2, head_dim=8, ffn=32, vocab=64)

# (shape, batch, seq, strategy, activation checkpointing, precision)
RUNS = (
    (GPT2_124M, 8, 512, "full_shard", "none", "bf16"),
    (GPT2_124M, 8, 512, "shard_grad_op", "full", "fp32"),
    (GPT2_350M, 4, 512, "full_shard", "full", "bf16"),
    (GPT2_350M, 4, 512, "no_shard", "none", "fp32"),
)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    mib = 2**20
    with sweep_device.one_rank_group(args.device) as device:
        sweep_device.warm_up(device)
        print("\n".join(sweep_device.DEVICE_HEADER))
        for i, (shape, batch, seq, strategy, ac, precision) in enumerate(RUNS):
            if device.type == "cpu":
                shape, batch, seq = TINY, 2, 16
            c = Config(0, i, "gpt", shape, batch, seq, strategy, ac, precision, 1, "fsdp1")
            d = sweep_device.run_on_device(dataclasses.replace(c), device)
            print(sweep_device.format_device_row(d), flush=True)
            e = d.row.estimate
            if e is not None and d.allocated:
                need = max(0.0, (d.allocated - CUDA_SLACK) / e.total - 1)
                print(
                    f"  allocator {d.allocated / mib:.2f} MiB, live {d.row.measured / mib:.2f} MiB, predicted "
                    f"{e.total / mib:.2f} MiB: share needed beside {CUDA_SLACK / mib:.0f} MiB {100 * need:.2f}% "
                    f"(planner keeps {100 * CUDA_MARGIN:.2f}%)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
