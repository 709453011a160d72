"""Where a training job writes, checked at start-up.

``--save-model`` is written after the last step and ``--metrics-file`` at the first log line, so
a path that cannot be written (a folder on it that is a file, a file where a folder is meant)
failed only after training, or as an OSError in every worker. Each path is checked here before
the workers start: its nearest existing folder must be a writable directory (the missing folders
below it are created when the job writes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FILES = ("save_model", "metrics_file")
FOLDERS = ("checkpoint_dir", "tensorboard")


def validate(cfg: Any) -> None:
    """Check the output paths of a job config: ``--save-model``, ``--metrics-file`` (files),
    ``--checkpoint-dir``, ``--tensorboard`` and, with ``--profile-steps``, ``--profile-dir``
    (folders), those that are set.

    Raises:
        ValueError: a path that cannot be written, naming the option, the path and why.
    """
    folders = [*FOLDERS, "profile_dir"] if getattr(cfg, "profile_steps", None) else FOLDERS
    for name, folder in [(n, False) for n in FILES] + [(n, True) for n in folders]:
        path = getattr(cfg, name, None)
        if path:
            _check(f"--{name.replace('_', '-')}", Path(path), folder)


def _check(option: str, path: Path, folder: bool) -> None:
    if folder and path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file, not a directory: give a directory (created if missing)")
    if not folder and path.is_dir():
        raise ValueError(f"{option} {path} is a directory: give the path of a file in it")
    existing = path if folder else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"{option} {path}: {existing} is a file, not a directory: give a path under a directory "
            "(missing folders are created)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: the directory {existing} is not writable: give a path you can write")
