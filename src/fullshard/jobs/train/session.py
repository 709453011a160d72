"""Where a training job's checkpoints and metrics go: its ``--checkpoint-dir``, or Ray Train.

The training loops call :func:`open_session` once and then ``resume``, ``save`` and ``report``;
they do not know who launched them. Under torch's launcher or ``torchrun`` checkpoints are
folders of ``--checkpoint-dir`` (see ``fullshard.checkpoint``). Under Ray Train
(``--launcher ray``) each worker saves into its own temporary directory and hands it to
``ray.train.report`` as a ``ray.train.Checkpoint``; Ray merges the workers' directories into one
complete checkpoint in the run's storage, and a restarted worker group resumes from
``ray.train.get_checkpoint()``. Either way the checkpoint loads at any world size.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullshard import checkpoint
from fullshard.jobs.checkpoint_cli import warnings_as_lines


@dataclasses.dataclass
class Resumed:
    """A loaded checkpoint: its optimizer step, this rank's extra state (empty for a rank that
    did not exist when it was saved) and where it was read from."""

    step: int
    extra: dict[str, Any]
    path: str


class Session:
    """Checkpoints in ``cfg.checkpoint_dir`` (the torch launcher, torchrun); metrics stay local."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Resumed | None:
        """Load the newest verified checkpoint into ``model`` and ``optimizer`` (collective);
        None when there is none. Newer ones that fail verification are skipped with a warning
        naming each and why (``fullshard.checkpoint.resume``); when every one fails, rank 0 also
        says that training starts from step 0."""
        if not self.cfg.checkpoint_dir:
            return None
        with warnings_as_lines() as seen:  # rank 0's line per checkpoint skipped
            found = checkpoint.resume(self.cfg.checkpoint_dir, model, optimizer)
        if found is None:
            skipped = sum(isinstance(w.message, checkpoint.CheckpointWarning) for w in seen)
            if skipped:  # issued on rank 0 alone
                print(
                    f"fullshard: none of the {skipped} checkpoint(s) in {self.cfg.checkpoint_dir} verified "
                    "(each is named above): training from step 0",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        return Resumed(checkpoint.step_of(found[0]), found[1], str(found[0]))

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
        """Save a sharded checkpoint of the state after optimizer step ``step`` (collective);
        a checkpoint that ``--keep-checkpoints`` leaves because it fails verification is named
        in one line on stderr."""
        with warnings_as_lines():
            checkpoint.save(self.cfg.checkpoint_dir, step, model, optimizer, extra, keep=self.cfg.keep_checkpoints)

    def report(self, record: dict[str, Any]) -> None:
        """Hand one log record to the launcher (nothing to do here; the jobs print and write it)."""


class RaySession(Session):
    """Checkpoints and metrics through Ray Train (``ray.train.report`` on every worker)."""

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Resumed | None:
        import ray.train

        found = ray.train.get_checkpoint()
        if found is None:
            return None
        with found.as_directory() as directory:
            extra = checkpoint.load(directory, model, optimizer)
        return Resumed(checkpoint.step_of(Path(found.path)), extra, found.path)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
        import ray.train

        local = Path(tempfile.mkdtemp(prefix="fullshard-ckpt-"))
        try:
            path = checkpoint.save(local, step, model, optimizer, extra)
            ray.train.report(
                {"step": step},
                checkpoint=ray.train.Checkpoint.from_directory(str(path)),
                checkpoint_dir_name=path.name,
            )
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def report(self, record: dict[str, Any]) -> None:
        import ray.train

        ray.train.report(record)


def open_session(cfg: Any) -> Session:
    """The session for a job config: Ray Train's under ``--launcher ray``, else the local one."""
    return RaySession(cfg) if getattr(cfg, "launcher", "torch") == "ray" else Session(cfg)
