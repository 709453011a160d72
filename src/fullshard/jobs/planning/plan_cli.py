"""``fullshard plan``: the fastest predicted FSDP configuration under a memory budget per rank.

    fullshard plan --model gpt:tiny --batch-size 16 --seq-len 128 --world-size 2 --memory-budget 64MiB
    fullshard plan --model mnist --batch-size 64 --world-size 2 --memory-budget 8MiB

Takes the models of ``fullshard estimate``. It starts ``--world-size`` local processes (gloo on
CPU, NCCL when CUDA is there) that calibrate this machine for a few seconds (collectives at that
world size, each block at the batch shape, the optimizer), then rank 0 scores every candidate
(:mod:`fullshard.plan.planner`) and prints the plan, its predicted peak by category and
step time, and the runners-up, or the smallest budget that would fit. Exit status 1 when
nothing fits, 2 on bad options or when a worker failed (its error in one line).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

from fullshard.jobs import launch
from fullshard.jobs.planning.cli import PRECISIONS, _model_parts, _parser, checked_model_parts
from fullshard.plan.planner import parse_size


def _worker(args: Any) -> list[str] | None:
    from fullshard.comm import collectives
    from fullshard.plan.planner import plan
    from fullshard.plan.steptime import calibrate

    device = launch.init_process_group()
    try:
        make, example, loss_fn, is_unit = _model_parts(args)
        dtype = PRECISIONS[args.mixed_precision]
        cal = calibrate(make, example, loss_fn, is_unit, device, compute_dtype=dtype, optimizer=args.optimizer)
        if collectives.group_rank(collectives.default_group()) != 0:
            return None
        result = plan(cal, make, example, loss_fn, is_unit, args.budget, param_dtype=dtype)
        return result.describe() if result.best is not None else ["NOTHING FITS", *result.describe()]
    finally:
        launch.destroy_process_group()


def _budget_joined(argv: list[str]) -> list[str]:
    """``--memory-budget -5MiB`` as ``--memory-budget=-5MiB``: argparse takes a value starting
    with "-" for an option, and would say "expected one argument" instead of what is wrong."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--memory-budget" and re.match(r"-[0-9.]", arg):
            out[-1] = f"--memory-budget={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str]) -> int:
    """Entry point of ``fullshard plan``; returns the exit code (1: nothing fits, 2: bad options or a
    worker failed)."""
    p = _parser()
    p.prog = "fullshard plan"
    p.description = __doc__
    p.add_argument("--memory-budget", required=True, help="bytes per rank, e.g. 8GiB or 512MiB")
    args = p.parse_args(_budget_joined(list(argv)))
    try:
        args.budget = parse_size(args.memory_budget)
    except ValueError as e:
        p.error(f"--memory-budget: {e}")
    if args.world_size < 1 or args.batch_size < 1:
        p.error("--world-size and --batch-size must be at least 1")
    try:
        checked_model_parts(args)
    except (ValueError, ImportError, AttributeError) as err:
        p.error(str(err))
    try:
        lines = launch.launch(_worker, (args,), args.world_size)[0]
    except launch.WorkerFailed as err:
        print(f"fullshard plan: {err.summary()}", file=sys.stderr)
        return 2
    assert lines is not None
    fits = lines[0] != "NOTHING FITS"
    print("\n".join(lines if fits else lines[1:]))
    return 0 if fits else 1
