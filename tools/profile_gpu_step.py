"""Profile one training step of the GPT preset on one CUDA device: fullshard vs unwrapped.

    python tools/profile_gpu_step.py [--preset 124m] [--batch 16] [--seq 1024] [--out DIR]

Prints, for fullshard (bf16 mixed precision) and the unwrapped model under autocast, the step's
wall time, the GPU busy time (sum of kernel times), the CPU time the Python side spent before the
last kernel was queued, and the top operators by CUDA time; writes a Chrome trace of each to
``--out``. Used to find where fullshard's time goes on a GPU (BENCHMARKS.md, issue 6).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fullshard.jobs import launch
from fullshard.jobs.bench.gpu import _build, _optimizer, _tokens, _train_step


def worker(preset: str, batch: int, seq: int, out: str) -> None:
    device = launch.init_process_group()
    try:
        x, y = _tokens(256, batch, seq, device)
        for impl in ("fullshard", "unwrapped, autocast bf16"):
            model = _build(impl, preset, device)
            opt = _optimizer(model.parameters(), device)
            step = functools.partial(_train_step, model, opt, x, y, impl.startswith("unwrapped, autocast"))
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            cpu_issue = time.perf_counter() - t0
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu = (
                sum(e.self_device_time_total for e in kernels) / 1e3
            )  # kernels only: ops carry their kernels' time too
            print(
                f"== {impl}: step {wall * 1e3:.1f} ms wall, {cpu_issue * 1e3:.1f} ms to queue it, GPU "
                f"kernels {gpu:.1f} ms"
            )
            print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
            if out:
                prof.export_chrome_trace(os.path.join(out, f"trace_{impl.split(',')[0]}.json"))
            del model, opt, step
    finally:
        launch.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="124m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", default="")
    a = p.parse_args()
    launch.launch(worker, (a.preset, a.batch, a.seq, a.out), 1)


if __name__ == "__main__":
    main()
