"""Sharded checkpoints (``fullshard.checkpoint.save`` / ``load`` / ``resume`` / ``latest`` /
``verify`` / ``consolidate``), and what a loop keeps beside them for an exact resume.

They live in :mod:`fullshard.state.checkpoint` (``is_checkpoint`` in
:mod:`fullshard.state.checkpoint_select`), and ``rounding_state`` / ``set_rounding_state`` (the
stochastic rounding generators of ``CommQuantization(grads="int8")``, per rank: save them in
the checkpoint's ``extra`` and restore them on resume) in :mod:`fullshard.comm.quantized`; this
module only re-exports them.
"""

from fullshard.comm.quantized import rounding_state, set_rounding_state
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
from fullshard.state.checkpoint_select import is_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "consolidate",
    "is_checkpoint",
    "latest",
    "load",
    "resume",
    "rounding_state",
    "save",
    "set_rounding_state",
    "step_dir",
    "step_of",
    "verify",
]
