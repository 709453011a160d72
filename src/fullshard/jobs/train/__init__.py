"""Training jobs: ``fullshard train JOB [options]``, or ``python -m fullshard.train JOB`` under torchrun.

Jobs: ``mnist`` (the PyTorch FSDP tutorial's model on real MNIST images) and ``gpt`` (a
byte-level decoder-only transformer on real text), ``hf`` (a Hugging Face transformers model).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

JOBS = ("mnist", "gpt", "hf")


def main(argv: Sequence[str] | None = None) -> int:
    """Run a training job named by the first argument; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: fullshard train {{{','.join(JOBS)}}} [options]  (--help after the job name for its options)")
        return 0 if args else 2
    job, rest = args[0], args[1:]
    if job == "mnist":
        from fullshard.jobs.train import mnist

        return mnist.main(rest)
    if job == "gpt":
        from fullshard.jobs.train import gpt

        return gpt.main(rest)
    if job == "hf":
        from fullshard.jobs.train import hf

        return hf.main(rest)
    print(f"fullshard train: unknown job {job!r}; choose one of: {', '.join(JOBS)}", file=sys.stderr)
    return 2
