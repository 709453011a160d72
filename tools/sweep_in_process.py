"""The estimator sweep of ``fullshard bench estimate --sweep N --seed S``, measured in this one
process: each configuration's rank 0 runs its three steps in torch's fake process group (the
collectives move no data; fullshard treats the group as gloo, so every buffer it allocates is
the one a real gloo rank allocates). Prints the same markdown report as the real sweep.

Usage: ``PYTHONPATH=src python tools/sweep_in_process.py SEED N``. Faster than launching N
worker processes per configuration, and checked against the multi-process measurement in
``docs/estimate_sweep_seed4242.md``; not a substitute for it on anything that depends on what
the collectives deliver (values, e.g. a mixture-of-experts routing).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from fullshard.comm import collectives
from fullshard.jobs.planning import sweep_bench
from fullshard.jobs.planning.sweep import Config, draw


def run_one(c: Config) -> sweep_bench.Row:
    """Predict ``c`` and measure rank 0 of it in a fake process group; failures become notes."""
    estimate, failure = None, ""
    try:
        estimate = sweep_bench.predict(c)
    except Exception as err:  # a trace failure is a result of the sweep
        failure = f"trace: {type(err).__name__}: {str(err)[:200]}"
    start = time.perf_counter()
    peak, moment = 0, ""
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=c.world)
        peak, moment, _ = sweep_bench.measure_rank(c, torch.device("cpu"))
    except Exception as err:  # so is a run failure
        failure = (failure + "; " if failure else "") + f"run: {type(err).__name__}: {str(err)[:200]}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return sweep_bench.Row(c, estimate, peak, moment, failure, time.perf_counter() - start)


def main(seed: int, n: int) -> None:
    collectives.backend = lambda group: "gloo"  # type: ignore[assignment]
    print(f"Seed {seed}, {n} configurations, rank 0 of each measured in one process (fake process group).\n")
    print("\n".join(sweep_bench.HEADER), flush=True)
    rows = []
    for c in draw(seed, n):
        rows.append(run_one(c))
        print(sweep_bench.format_row(rows[-1]), flush=True)
    print()
    print("\n".join(sweep_bench.summary(rows)))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
