"""Which checkpoint a load takes: the one named, or the newest verified one of a folder.

A path that is a checkpoint (it holds ``.metadata`` or ``manifest.json``, or is named like
``step_00000120``) is verified and taken, or refused with every problem named; a checkpoint
without a manifest is taken with a warning that it is unverified. A folder of ``step_*``
checkpoints gives its newest verified one: each newer folder that fails (a checksum mismatch, a
missing or truncated file, a missing ``.metadata``, no manifest) is skipped with a warning that
names it and why. ``step_*.tmp`` folders (interrupted saves) are never candidates.

Ranks verify a checkpoint together (:func:`verify_together`): each hashes its share of the
files and all of them see every rank's findings, so every rank takes the same checkpoint.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

from fullshard.comm import collectives
from fullshard.state import checkpoint_manifest as manifests
from fullshard.state.checkpoint_errors import CheckpointError
from fullshard.state.checkpoint_manifest import MANIFEST, METADATA, Manifest

STEP = re.compile(r"^step_(\d{8})$")
Verdict = tuple[Manifest | None, list[str]]  # (the manifest, or None without one; problems found)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped, or is loaded without verification (the reason named)."""


def unverified_reason(directory: Path, named: bool = False) -> str:
    """Why a checkpoint without a manifest cannot be verified; unless it was ``named`` by the
    caller, how to load it anyway."""
    why = f"{manifests.NO_MANIFEST} (saved before fullshard wrote checksums, or not by fullshard)"
    return why if named else f"{why}; checkpoint.load({str(directory)!r}) loads it unverified"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is meant as one checkpoint rather than a folder of them."""
    return (path / METADATA).is_file() or (path / MANIFEST).is_file() or bool(STEP.match(path.name))


def step_folders(root: Path) -> list[Path]:
    """The ``step_*`` folders of ``root``, newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP.match(p.name) and p.is_dir()), key=lambda p: p.name, reverse=True)


def verify_here(directory: Path) -> Verdict:
    """Verify the checkpoint in ``directory`` in this process alone (every byte hashed here)."""
    manifest, problems = manifests.check(directory)
    return manifest, problems + _renamed(directory, manifest)


def _renamed(directory: Path, manifest: Manifest | None) -> list[str]:
    """A ``step_N`` folder whose manifest says it was saved at another step (a renamed or copied
    checkpoint would resume at the wrong step: the jobs take the step from the name)."""
    m = STEP.match(directory.name)
    if manifest is None or manifest.step is None or m is None or int(m.group(1)) == manifest.step:
        return []
    return [f"{MANIFEST}: saved at step {manifest.step}, but the folder is named {directory.name} (renamed or copied?)"]


def verify_together(directory: Path) -> Verdict:
    """Verify the checkpoint in ``directory`` on every rank, each hashing its share of the
    files (collective); every rank gets the same verdict: all ranks' problems, in order."""
    group = collectives.default_group()
    rank, world = collectives.group_rank(group), collectives.group_size(group)
    try:
        listed = manifests.read(directory)
    except ValueError:
        listed = None  # check() names the problem
    share = manifests.shares(listed, world)[rank] if listed is not None else set()
    manifest, problems = manifests.check(directory, hashed=share)
    gathered = collectives.all_gather_object((manifest is not None, problems), group)
    seen: list[str] = []
    for _, found in gathered:
        seen += [p for p in found if p not in seen]
    has = [bool(h) for h, _ in gathered]
    if any(has) and not all(has):
        seen += [f"{MANIFEST}: missing on rank {r}" for r, h in enumerate(has) if not h]
    return (manifest if all(has) else None), seen + _renamed(directory, manifest)


def candidates_together(path: Path) -> list[Path]:
    """The checkpoints ``path`` names, newest first, as any rank sees them (collective): itself
    when it is a checkpoint, else its ``step_*`` folders."""
    group = collectives.default_group()
    local = (is_checkpoint(path), [p.name for p in step_folders(path)])
    gathered = collectives.all_gather_object(local, group)
    if any(named for named, _ in gathered):
        return [path]
    names = {n for _, found in gathered for n in found}
    return [path / n for n in sorted(names, reverse=True)]


def candidates_here(path: Path) -> list[Path]:
    """The checkpoints ``path`` names, newest first, as this process sees them."""
    return [path] if is_checkpoint(path) else step_folders(path)


def choose(
    path: Path, candidates: list[Path], verify: Callable[[Path], Verdict], warn: bool
) -> tuple[Path, Manifest | None] | None:
    """The checkpoint to load from ``candidates`` (newest first) and its manifest; None when a
    folder holds no verified one. ``warn``: issue the warnings here (one rank of several).

    Raises:
        CheckpointError: ``path`` is itself a checkpoint and fails verification (every problem
            named: the file, the rank that wrote it, what is wrong).
    """
    for directory in candidates:
        manifest, problems = verify(directory)
        if directory == path:  # named by the caller: no fallback
            if problems:
                raise CheckpointError(f"checkpoint {directory} failed verification: " + "; ".join(problems))
            if manifest is None and warn:
                why = unverified_reason(directory, named=True)
                warnings.warn(f"fullshard: loading checkpoint {directory} unverified: {why}", CheckpointWarning, 4)
            return directory, manifest
        if manifest is not None and not problems:
            return directory, manifest
        if warn:
            reasons = "; ".join(problems) if problems else unverified_reason(directory)
            warnings.warn(f"fullshard: skipping checkpoint {directory}: {reasons}", CheckpointWarning, stacklevel=4)
    return None


def choose_together(path: Path) -> tuple[Path, Manifest | None] | None:
    """:func:`choose` on every rank together (collective); rank 0 issues the warnings."""
    rank = collectives.group_rank(collectives.default_group())
    return choose(path, candidates_together(path), verify_together, warn=rank == 0)


def choose_here(path: Path) -> tuple[Path, Manifest | None] | None:
    """:func:`choose` in this process alone (no process group)."""
    return choose(path, candidates_here(path), verify_here, warn=True)


def newest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (a manifest, and every file it lists at its
    listed size; no byte read), warning about each newer folder it passes over and why."""
    for directory in step_folders(root):
        manifest, problems = manifests.check(directory, hashed=())
        if manifest is not None and not problems:
            return directory
        reasons = "; ".join(problems) if problems else unverified_reason(directory)
        warnings.warn(f"fullshard: skipping checkpoint {directory}: {reasons}", CheckpointWarning, stacklevel=3)
    return None
