"""Checkpoints that reshard to another world size, on a seed's drawn configurations: a markdown table.

For each configuration of ``fullshard.jobs.planning.sweep.draw(seed, n)`` (model family and
shape, strategy, activation checkpointing, precision, front end; its world size is not used),
:func:`fullshard.jobs.planning.reshard.draw_case` draws the world size that saves and the one
that loads (1-4), the optimizer (AdamW, SGD with momentum, Adagrad) and the checkpoint path
(``fullshard.checkpoint``, torch's DCP with ``get_state_dict`` / ``set_state_dict``, and on the
FSDP1 wrapper its SHARDED and FULL state dicts with ``FSDP.optim_state_dict``). In processes on
this machine (gloo): fullshard trains two steps at the first world size and saves; at the second
it builds the model afresh, loads, and the full parameters and optimizer state gathered are
compared with the saved ones (largest absolute difference; 0 is bit for bit). Then one more
step, compared with the same step of torch's own FSDP loaded from the same checkpoint through
the same path (or, where torch's load fails, an unsharded fp32 model given the saved state).

Usage (nothing is timed)::

    PYTHONPATH=src python tools/reshard_sweep.py SEED N [--start I]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time

from fullshard.jobs import launch
from fullshard.jobs.planning import reshard, sweep_bench
from fullshard.jobs.planning.sweep import draw


def _diff(x: float) -> str:
    return "missing" if math.isnan(x) else ("0" if x == 0.0 else f"{x:.1e}")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("seed", type=int)
    p.add_argument("n", type=int)
    p.add_argument("--start", type=int, default=0)
    a = p.parse_args(argv)
    print(f"Seed {a.seed}, configurations {a.start}-{a.n - 1}: 2 steps at W1, save, load at W2, 1 step.\n")
    print(
        "| configuration | W1->W2 | optimizer | path | params max diff | optimizer state max diff "
        "| torch loads it bitwise | next step vs | update error | loss error | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results: list[reshard.Result] = []
    failures: list[str] = []
    for c in draw(a.seed, a.n)[a.start :]:
        case = reshard.draw_case(c)
        c = dataclasses.replace(c, world=case.saved)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="reshard-") as directory:
            try:
                saved = launch.launch(reshard.save_worker, (c, case, directory), case.saved, env=launch.BENCH_ENV)[0]
                ours, theirs = launch.launch(
                    reshard.load_worker, (c, case, directory), case.loaded, env=launch.BENCH_ENV
                )[0]
                r = reshard.compare(c, case, saved, ours, theirs)
                results.append(r)
                kinds = ", ".join(f"{k} {_diff(v)}" for k, v in sorted(r.optim.items()))
                vs = "torch" if r.reference == "torch" else r.reference.replace("|", "\\|")
                torch_load = {True: "yes", False: "no", None: "-"}[r.torch_load]
                row = f"{_diff(r.params)} | {kinds} | {torch_load} | {vs} | {r.update_error:.1e} | {r.loss_error:.1e}"
            except launch.WorkerFailed as err:
                first = str(err).splitlines()[0][:200].replace("|", "\\|")
                failures.append(f"{c.describe()} {case.describe()}: {first}")
                row = f"failed: {first} | - | - | - | - | -"
        cell = sweep_bench.cell(dataclasses.replace(c, world=case.loaded)).rsplit(" w", 1)[0]
        api = c.api
        print(
            f"| {cell} {api} | {case.saved}->{case.loaded} | {case.optim} | {case.path} | {row} | "
            f"{time.perf_counter() - start:.0f} |",
            flush=True,
        )
    print()
    for line in reshard.summary(results, failures):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
