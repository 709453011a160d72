"""The ``fullshard`` command: ``fullshard train JOB [options]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: fullshard COMMAND ...

commands:
  train JOB [options]   run a training job across processes (jobs: mnist, gpt, hf)
  bench WORKLOAD        time fullshard (compare, gpu, prefetch, optimizer, recorder, estimate, steptime)
  convert CKPT OUT      write a sharded checkpoint as one full state dict (.safetensors or .pt)
  verify CKPT           check every file of a checkpoint (or of each in a folder) against its manifest
  plot METRICS... -o F  draw loss, throughput and per-rank memory of runs' metrics files
  estimate --model M    predict memory per rank of an FSDP configuration (nothing allocated)
  plan --model M --memory-budget SIZE
                        choose units' sharding, checkpointing and prefetch for a budget per rank
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``fullshard`` subcommands; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "train":
        from fullshard.jobs.train import main as train_main

        return train_main(rest)
    if command in ("convert", "verify"):
        from fullshard.jobs.checkpoint_cli import convert_main, verify_main

        return convert_main(rest) if command == "convert" else verify_main(rest)
    if command == "plot":
        from fullshard.jobs.plot import main as plot_main

        return plot_main(rest)
    if command == "estimate":
        from fullshard.jobs.planning.cli import main as estimate_main

        return estimate_main(rest)
    if command == "plan":
        from fullshard.jobs.planning.plan_cli import main as plan_main

        return plan_main(rest)
    if command == "bench":
        from fullshard.jobs.bench.main import main as bench_main

        if argv is None:  # the command itself: its own process, whose launches fork with the bench environment
            from fullshard.jobs.launch import use_bench_environment

            use_bench_environment()

        return bench_main(rest)
    print(f"fullshard: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
