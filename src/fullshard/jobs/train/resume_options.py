"""The checkpoint and restart options every training job takes on its command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fullshard.checkpoint import is_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add --checkpoint-dir, --checkpoint-every, --keep-checkpoints and --max-restarts."""
    p.add_argument(
        "--checkpoint-dir", default=None, metavar="DIR", help="sharded checkpoints; resume from the newest on start"
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N optimizer steps (0: never)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="complete checkpoints to keep")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers this often after a failure")


def validate(cfg: Any) -> None:
    """Check a job config's checkpoint fields.

    Raises:
        ValueError: negative counts, --checkpoint-every without --checkpoint-dir, a
            --checkpoint-dir that is a checkpoint itself (named ``step_N`` or holding its files):
            the job would resume from it on every start and save its new checkpoints inside it,
            where no restart looks. (That it can be written is :mod:`output_paths`'s check.)
    """
    if cfg.checkpoint_every < 0 or cfg.keep_checkpoints < 1 or cfg.max_restarts < 0:
        raise ValueError("--checkpoint-every and --max-restarts must be >= 0, --keep-checkpoints >= 1")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
    if cfg.checkpoint_dir and is_checkpoint(Path(cfg.checkpoint_dir)):
        parent = Path(cfg.checkpoint_dir).parent
        raise ValueError(
            f"--checkpoint-dir {cfg.checkpoint_dir} is a checkpoint (or named like one), not a folder of them: "
            f"pass its parent, --checkpoint-dir {parent} (the job resumes from the newest step_* folder in it "
            "and saves its checkpoints beside it)"
        )
