"""Sharded checkpoints (``fullshard.checkpoint.save`` / ``load`` / ``latest`` / ``consolidate``).

They live in :mod:`fullshard.state.checkpoint`; this module only re-exports them.
"""

from fullshard.state.checkpoint import CheckpointError, consolidate, latest, load, save, step_dir

__all__ = ["CheckpointError", "consolidate", "latest", "load", "save", "step_dir"]
