"""``fullshard convert CKPT OUT`` and ``fullshard verify CKPT``: checkpoints from the command line.

``verify`` checks one checkpoint directory, or every ``step_*`` checkpoint in a folder, against
its manifest (every file present, at its size, with its checksum) in this process: one line per
bad file on stderr (``fullshard verify: DIR: __1_0.distcp (written by rank 1): checksum
mismatch``), one ``verified`` line per good checkpoint on stdout; exit status 0 when every
checkpoint verified, 1 otherwise. ``convert`` verifies before it converts.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path


def convert_main(args: Sequence[str]) -> int:
    """``fullshard convert CKPT OUT``; returns the exit status (0 written, 1 failed, 2 usage)."""
    if len(args) != 2:
        print("usage: fullshard convert CKPT OUT  (OUT ends in .safetensors or .pt)", file=sys.stderr)
        return 2
    from fullshard.state.checkpoint import CheckpointError, consolidate

    with warnings_as_lines():
        try:
            out, failure = consolidate(args[0], args[1]), None
        except (CheckpointError, ValueError, OSError) as e:
            failure = e
    if failure is not None:
        print(f"fullshard convert: {failure}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[list[warnings.WarningMessage]]:
    """Print the checkpoint warnings raised in the block as one line each on stderr (no source
    line under them); other warnings are shown as usual. Yields the list the block's warnings
    are recorded in (complete once the block ends)."""
    from fullshard.state.checkpoint import CheckpointWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", CheckpointWarning)
        try:
            yield seen
        finally:
            for w in seen:
                if issubclass(w.category, CheckpointWarning):
                    print(str(w.message), file=sys.stderr, flush=True)
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def verify_main(args: Sequence[str]) -> int:
    """``fullshard verify CKPT``; returns the exit status (0 verified, 1 a problem, 2 usage)."""
    if len(args) != 1 or args[0].startswith("-"):
        print(
            "usage: fullshard verify CKPT  (a checkpoint directory, or a folder of step_* checkpoints)", file=sys.stderr
        )
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    from fullshard.state import checkpoint_manifest as manifests
    from fullshard.state.checkpoint import verify
    from fullshard.state.checkpoint_select import candidates_here, is_checkpoint

    path = Path(args[0])
    found = candidates_here(path)
    if not found:
        print(f"fullshard verify: {path} is not a checkpoint and holds no step_* checkpoint", file=sys.stderr)
        return 1
    bad = 0
    for directory in found:
        problems = verify(directory)
        for problem in problems:
            print(f"fullshard verify: {directory}: {problem}", file=sys.stderr)
        if problems:
            bad += 1
            continue
        listed = manifests.read(directory)
        files = listed.files.values() if listed else ()
        size = sum(e.size for e in files) / 2**20
        print(f"verified {directory}: {len(files)} files, {size:.1f} MiB")
    if bad and not is_checkpoint(path):
        print(f"fullshard verify: {bad} of {len(found)} checkpoints in {path} failed", file=sys.stderr)
    return 1 if bad else 0
