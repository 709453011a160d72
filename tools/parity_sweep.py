"""fullshard against torch's own FSDP on a seed's drawn configurations: a markdown table.

For each configuration of ``fullshard.jobs.planning.sweep.draw(seed, n)`` (model family and
shape, strategy, activation checkpointing, precision, world size 1, 2 or 4, front end), in
processes on this machine (gloo): :func:`fullshard.jobs.planning.parity.compare_rank` trains
fullshard and torch's FSDP (``fully_shard``, or FSDP1 with ``device_id=torch.device("cpu")``)
with the same settings, and an unsharded fp32 reference in one process. The row says whether
fullshard is torch's bit for bit, and each one's update error and loss error against the
reference; the summary compares the two where they differ.

What to expect: 1 and 2 ranks bitwise (a sum of two is the same in either order); at 4 ranks
gloo's reduce-scatter (an all-reduce) and fullshard's (an all-to-all and a local sum) add in
different orders, about 1e-6 of the update in fp32, and bf16 reductions round more.

Usage (nothing is timed: the machine need not be idle)::

    PYTHONPATH=src python tools/parity_sweep.py SEED N [--start I] [--steps 3] [--optim adamw|sgd]
        [--world W] [--accumulate K] [--extras]

``--extras`` adds to each configuration the options :func:`fullshard.jobs.planning.parity.draw_extras`
draws for it (clipping, prefetch, CPU offload), the same on fullshard, torch and the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from fullshard.jobs import launch
from fullshard.jobs.planning import parity, sweep_bench
from fullshard.jobs.planning.sweep import draw


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("seed", type=int)
    p.add_argument("n", type=int)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--optim", choices=parity.OPTIMIZERS, default="adamw")
    p.add_argument("--world", type=int, default=0, help="run every draw at this world size instead of its own")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step, sync off for all but the last")
    p.add_argument("--extras", action="store_true", help="draw clipping, prefetch and CPU offload per configuration")
    a = p.parse_args(argv)
    how = "AdamW steps (lr 1e-3)" if a.optim == "adamw" else "SGD steps (lr 1e-2, momentum 0.9)"
    micro = f", {a.accumulate} micro-batches each (sync off for all but the last)" if a.accumulate > 1 else ""
    print(f"Seed {a.seed}, configurations {a.start}-{a.n - 1}, {a.steps} {how}{micro}.\n")
    print("| configuration | = torch, bitwise | update error: fullshard / torch | loss error: fullshard / torch | s |")
    print("|---|---|---|---|---|")
    results: list[parity.Result] = []
    for c in draw(a.seed, a.n)[a.start :]:
        c = dataclasses.replace(c, world=a.world) if a.world else c
        extras = parity.draw_extras(c) if a.extras else parity.NO_EXTRAS
        start = time.perf_counter()
        try:
            r = launch.launch(
                parity.worker, (c, a.steps, a.optim, a.accumulate, extras), c.world, env=launch.BENCH_ENV
            )[0]
            assert r is not None
            results.append(r)
            row = (
                f"{'yes' if r.bitwise else 'no'} | {r.update_error[0]:.1e} / {r.update_error[1]:.1e} | "
                f"{r.loss_error[0]:.1e} / {r.loss_error[1]:.1e}"
            )
        except launch.WorkerFailed as err:
            row = f"failed: {str(err).splitlines()[0][:160]} | - | -"
        cell = sweep_bench.cell(c) + (f" \\| {extras.describe()}" if extras.describe() else "")
        print(f"| {cell} | {row} | {time.perf_counter() - start:.0f} |", flush=True)
    print()
    for line in parity.summary(results):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
