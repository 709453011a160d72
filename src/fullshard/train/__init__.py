"""``python -m fullshard.train JOB ...`` (the entry point for torchrun) and ``fullshard.train.main``.

The jobs live in :mod:`fullshard.jobs.train`; this package only re-exports their entry point.
"""

from fullshard.jobs.train import JOBS, main

__all__ = ["JOBS", "main"]
