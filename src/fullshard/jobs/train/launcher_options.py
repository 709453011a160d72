"""The options that choose who starts a training job's workers: torch's elastic launcher (the
default, or ``torchrun`` around the job) or Ray Train."""

from __future__ import annotations

import argparse
import os
from typing import Any

from fullshard import enable_watchdog
from fullshard.jobs import ray_launcher


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add --launcher, --num-workers, --use-gpu and --ray-address."""
    p.add_argument(
        "--launcher",
        choices=("torch", "ray"),
        default="torch",
        help="who starts the workers: torch's elastic launcher (--nproc of them) or Ray Train",
    )
    p.add_argument(
        "--num-workers",
        default=None,
        metavar="N|MIN:MAX",
        help="Ray Train workers, or an elastic range Ray chooses in (default: --nproc)",
    )
    p.add_argument("--use-gpu", action="store_true", help="Ray Train: one GPU per worker, NCCL")
    p.add_argument("--ray-address", default=None, metavar="ADDR", help="an existing Ray cluster (default: a local one)")
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a collective waiting longer stops the job, naming the ranks that did not join it "
        "(default: FULLSHARD_COLLECTIVE_TIMEOUT, else the process group's timeout, 300)",
    )


def validate(cfg: Any) -> None:
    """Check the launcher fields of a job config; fill ``num_workers`` from ``nproc``.

    Raises:
        ValueError: Ray options without ``--launcher ray``; a bad ``--num-workers``; Ray not
            installed (naming ``pip install 'fullshard[ray]'``); a non-positive
            ``--collective-timeout``.
    """
    timeout = getattr(cfg, "collective_timeout", None)
    if timeout is not None:
        if not timeout > 0:
            raise ValueError(f"--collective-timeout {timeout}: give a positive number of seconds")
        os.environ["FULLSHARD_COLLECTIVE_TIMEOUT"] = str(timeout)  # the workers inherit it
    if cfg.launcher != "ray":
        if cfg.num_workers is not None or cfg.use_gpu or cfg.ray_address:
            raise ValueError("--num-workers, --use-gpu and --ray-address need --launcher ray")
        return
    if cfg.num_workers is None:
        cfg.num_workers = str(cfg.nproc)
    ray_launcher.parse_num_workers(cfg.num_workers)
    ray_launcher.require_ray()


def watchdog_on() -> None:
    """Turn the watchdog and the divergence check on in a job's worker, unless
    ``FULLSHARD_WATCHDOG=0``: training jobs run with them, library users opt in."""
    if os.environ.get("FULLSHARD_WATCHDOG", "1").strip().lower() not in ("0", "false", "no", "off"):
        enable_watchdog()
