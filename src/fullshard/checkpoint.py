"""Sharded checkpoints (``fullshard.checkpoint.save`` / ``load`` / ``resume`` / ``latest`` /
``verify`` / ``consolidate``).

They live in :mod:`fullshard.state.checkpoint`; this module only re-exports them.
"""

from fullshard.state.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    consolidate,
    latest,
    load,
    resume,
    save,
    step_dir,
    step_of,
    verify,
)

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "consolidate",
    "latest",
    "load",
    "resume",
    "save",
    "step_dir",
    "step_of",
    "verify",
]
