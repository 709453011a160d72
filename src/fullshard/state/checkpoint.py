"""Sharded checkpoints on torch.distributed.checkpoint: atomic, verified, resharding, safe to crash in.

Layout: ``ROOT/step_00000120/`` holds one checkpoint: DCP's files (every rank writes its shards
``__{rank}_0.distcp``, rank 0 writes ``.metadata``), ``extra_rank{r}.pt`` (each rank's own
extra state, such as RNG states) and ``manifest.json`` (every file's size, writer and checksum:
:mod:`fullshard.state.checkpoint_manifest`). A save writes into ``step_00000120.tmp/``, hashes
every file, writes the manifest last, and renames the directory, so a directory without ``.tmp``
is complete: a crash during a save leaves the previous checkpoint as the newest complete one.
``keep`` prunes older verified checkpoints, never the one just written.

Loads verify every file's checksum first (the ranks share the hashing) and are all-or-nothing:
everything is read and checked (checksums, keys, shapes, the optimizer's state keys) before the
model or optimizer changes, so a failed load leaves both bitwise as they were. A folder of
checkpoints gives its newest verified one; newer ones that fail are skipped with a warning
naming each and why (:mod:`fullshard.state.checkpoint_select`). A checkpoint without a manifest
(saved by fullshard before checksums, or by DCP itself) loads when named, with a warning that it
is unverified, and is never picked from a folder, nor counted or removed by ``keep``.

``ROOT`` may be shared by all ranks (rank 0 renames the directory) or local to each rank or
node (each directory's lowest rank renames it): then every rank's directory holds its own
shards, the manifest of all of them, and rank 0's the metadata; merging the directories (as Ray
Train does with the directories its workers report) gives one complete checkpoint.

The model and optimizer state are sharded state dicts (DTensor ``Shard(0)`` entries), so a
checkpoint saved at one world size loads at any other. Errors on any rank are raised on every
rank as :class:`CheckpointError`, one line naming the failed rank and the cause
(``checkpoint save to DIR failed on rank 1: No space left on device (writing __1_0.distcp)``);
nothing hangs.
"""

from __future__ import annotations

import operator
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullshard.comm import collectives, flight_recorder
from fullshard.engine.inference_guard import outside_inference_mode
from fullshard.state import checkpoint_manifest as manifests
from fullshard.state import checkpoint_select as select
from fullshard.state.checkpoint_errors import CheckpointError, FileFailure, everywhere, reasons
from fullshard.state.checkpoint_io import Reader, Writer, extra_name, load_extra, save_extra
from fullshard.state.checkpoint_manifest import MANIFEST, METADATA, Manifest
from fullshard.state.checkpoint_select import STEP as _STEP
from fullshard.state.checkpoint_select import CheckpointWarning  # noqa: F401  (re-exported)
from fullshard.state.checkpoint_state import apply, check_fits, copies, create_optimizer_state, forget_state, sharded


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step_{step:08d}"


def step_of(path: str | os.PathLike) -> int:
    """The step a checkpoint directory was saved at, from its name (``step_00000120`` -> 120).

    Raises:
        ValueError: the name is not ``step_`` and 8 digits.
    """
    m = _STEP.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint of a step (step_00000120)")
    return int(m.group(1))


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``root`` (None when there is none).

    Complete: it has a manifest, and every file the manifest lists is there at its listed size.
    No byte is read here (:func:`load` and :func:`verify` check the checksums). Each newer
    ``step_*`` folder passed over raises a :class:`CheckpointWarning` naming it and why.
    """
    return select.newest_complete(Path(root))


@flight_recorder.labelled("checkpoint save")
def save(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) as ``root/step_{step}`` (collective).

    Args:
        root: the checkpoint folder (created if needed).
        step: the training step; names the directory.
        model: the root FullyShardedDataParallel, or the root module given to ``fully_shard``.
        optimizer: an optimizer over ``model.parameters()``.
        extra: this rank's own picklable state (RNG states, a scheduler, data position).
        keep: keep only this many newest verified checkpoints, the new one among them (None:
            all). Only checkpoints with a manifest that verify count; one that fails is left,
            with a :class:`CheckpointWarning`; the new one is never removed.

    Returns:
        the directory of the new, complete checkpoint.

    Raises:
        TypeError: ``step`` not an int, or ``keep`` neither an int nor None (on any rank).
        ValueError: ``step`` < 0 or ``keep`` < 1 (on any rank), or ranks giving different steps.
            These are raised on every rank before anything is written.
        CheckpointError: on every rank, when any rank failed (one line naming the rank, the
            reason and the file); the previous checkpoints stay.
    """
    import torch.distributed.checkpoint as dcp

    group = collectives.default_group()
    rank, world = collectives.group_rank(group), collectives.group_size(group)
    token, step = _agree(step, keep, group)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    action = f"save to {final}"
    leader = _claim(tmp, action, token)
    writer = Writer(tmp)

    def gather_state() -> tuple[dict[str, Any], str]:
        return sharded(model, optimizer), save_extra(tmp, rank, extra or {})

    state, extra_file = everywhere(action, gather_state)

    # Inside dcp.save a failure on one rank reaches every rank through DCP's own collectives,
    # so all ranks leave it together and meet again in everywhere.
    def write_and_hash() -> dict[str, manifests.FileEntry]:
        dcp.save(state, storage_writer=writer, checkpoint_id=str(tmp))
        mine = writer.written | {extra_file} | ({METADATA} if rank == 0 else set())  # rank 0: DCP's coordinator
        return manifests.entries(tmp, mine, rank)

    files = everywhere(action, write_and_hash)
    listed = {name: e for part in collectives.all_gather_object(files, group) for name, e in part.items()}
    manifest = Manifest(listed, world, step, type(optimizer).__name__ if optimizer is not None else None)
    everywhere(action, lambda: _publish(tmp, final, manifest, keep) if rank == leader else None)
    return final


def _publish(tmp: Path, final: Path, manifest: Manifest, keep: int | None) -> None:
    """Write the manifest (last: every rank's files are complete), rename ``tmp`` to ``final``, prune."""
    try:
        manifests.write(tmp, manifest)
    except OSError as e:
        raise FileFailure.of(MANIFEST, "writing", e) from e
    for claim in tmp.glob(f"{_CLAIM}*"):
        claim.unlink()
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _remember(final, [])  # its manifest was made from the bytes on disk
    _prune(final.parent, keep, final, here_only=any(not (final / name).exists() for name in manifest.files))


def _agree(step: Any, keep: Any, group: collectives.ProcessGroup) -> tuple[str, int]:
    """Check every rank's ``step`` and ``keep`` together (one exchange, which also hands out rank
    0's token for :func:`_claim`): the same error on every rank, before anything is written.
    Ranks saving different steps would each publish a checkpoint missing the others' shards (and,
    with ``keep``, prune the good ones): refused. Returns (the token, ``step`` as an int)."""
    import uuid

    rank = collectives.group_rank(group)
    every = collectives.all_gather_object((uuid.uuid4().hex if rank == 0 else None, step, keep), group)
    for r, (_, s, k) in enumerate(every):
        on = f" on rank {r}" if len({repr(e[1:]) for e in every}) > 1 else ""
        n = _whole(s)
        if n is None:
            raise TypeError(
                "checkpoint.save: step must be an int (the training step, which names the checkpoint's "
                f"directory step_00000120), got {type(s).__name__} {s!r}{on}"
            )
        if n < 0:
            raise ValueError(f"checkpoint.save: step must be at least 0, got {s!r}{on}")
        if k is not None and (_whole(k) or 0) < 1:
            raise (TypeError if _whole(k) is None else ValueError)(
                "checkpoint.save: keep must be an int of at least 1 or None (None keeps every checkpoint), got "
                f"{type(k).__name__} {k!r}{on}"
            )
    steps = [_whole(s) for _, s, _ in every]
    if len(set(steps)) > 1:
        said = ", ".join(f"step {s} on rank {r}" for r, s in enumerate(steps))
        raise ValueError(
            f"checkpoint.save: every rank must save the same step, got {said} (a step counted on each rank?)"
        )
    return every[0][0], int(step)


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is one (numpy's and 0-dim tensors' too), else None (a bool too)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


_CLAIM = ".fullshard-claim-"


def _claim(tmp: Path, action: str, token: str) -> int:
    """Prepare the temporary directory ``tmp`` of a save; return the rank that publishes it.

    ``tmp`` may be one directory every rank sees (a shared file system) or a directory per rank
    or per node (Ray Train's idiom: each worker saves into its own local directory and Ray merges
    them). Every rank creates ``tmp`` and leaves a claim file with this save's token in it; the
    lowest rank whose claim a rank sees is that directory's leader, which empties it of anything
    older (an interrupted save) and later renames it. Collective; a failure on any rank raises
    CheckpointError on all. ``token``: this save's, the same on every rank.
    """
    group = collectives.default_group()
    rank = collectives.group_rank(group)
    mine = f"{_CLAIM}{token}-"

    def create() -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / f"{mine}{rank}").touch()

    everywhere(action, create)  # its closing all-reduce is the barrier: every claim is written

    def clean() -> int:
        leader = min(int(p.name[len(mine) :]) for p in tmp.glob(f"{mine}*"))
        if rank == leader:
            for p in tmp.iterdir():
                if not p.name.startswith(mine):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        return leader

    return everywhere(action, clean)


def _prune(root: Path, keep: int | None, new: Path, here_only: bool = False) -> None:
    """Remove all but the ``keep`` newest verified checkpoints, ``new`` kept whatever its step.

    Newest first, each checkpoint with a manifest is verified (every byte hashed, once per process:
    :func:`_problems`) until ``keep - 1`` have passed; one that fails is neither counted nor
    removed, with a warning (resuming passes over it), and all older than the last one counted go.
    Folders without a manifest are left alone. ``here_only``: ``root`` is a directory per rank or
    node, which holds only some ranks' files (the manifest lists all of them).
    """
    if keep is None:
        return
    others = [p for p in select.step_folders(root) if p != new and (p / MANIFEST).is_file()]  # newest first
    counted = 0
    for old in others:
        if counted == keep - 1:
            shutil.rmtree(old, ignore_errors=True)
            continue
        problems = _problems(old, here_only)
        if problems is None:
            counted += 1
        elif problems:
            warnings.warn(
                f"fullshard: not counting checkpoint {old} towards keep={keep}, nor removing it: "
                + "; ".join(problems),
                CheckpointWarning,
                stacklevel=2,
            )


_VERDICTS: dict[tuple[Path, int], list[str]] = {}  # (checkpoint, its manifest's mtime): its problems


def _remember(directory: Path, problems: list[str]) -> None:
    """Note what verifying ``directory`` found (``[]``: verified), for this process's prunes."""
    try:
        _VERDICTS[(directory, (directory / MANIFEST).stat().st_mtime_ns)] = problems
    except OSError:
        pass


def _problems(directory: Path, here_only: bool) -> list[str] | None:
    """None when the checkpoint in ``directory`` verifies; else its problems, the first time
    they are found in this process (``[]`` after that, or when it is gone meanwhile)."""
    try:
        key = (directory, (directory / MANIFEST).stat().st_mtime_ns)
    except OSError:
        return []
    if key in _VERDICTS:
        return None if not _VERDICTS[key] else []
    problems = manifests.check(directory, here_only=here_only)[1]
    _VERDICTS[key] = problems
    return None if not problems else problems


@flight_recorder.labelled("checkpoint load")
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``), at any world size (collective).

    Every file's checksum is verified first (the ranks share the hashing), then every file is
    read and checked before anything in the model or optimizer changes.

    Args:
        path: a checkpoint directory, or a folder of them (its newest verified one is loaded;
            newer ones that fail verification are skipped with a :class:`CheckpointWarning`).

    Returns:
        this rank's ``extra`` from the save (empty when it was saved by no rank of this number).

    Raises:
        CheckpointError: on every rank: no checkpoint at ``path``; a file that fails
            verification (named with the rank that wrote it); missing or unexpected keys, a
            shape mismatch, an optimizer whose state keys the checkpoint lacks (named);
            unreadable files. The model and optimizer are bitwise unchanged then.
    """
    chosen = select.choose_together(Path(path))
    if chosen is None:
        raise CheckpointError(_nothing_to_load(Path(path)))
    if chosen[1] is not None:
        _remember(chosen[0], [])
    return _read_and_apply(*chosen, model, optimizer)


def _nothing_to_load(path: Path) -> str:
    found = len(select.step_folders(path))
    if found:
        return (
            f"{path} holds no verified checkpoint: each of its {found} step_* folder(s) was skipped (see the "
            "warnings); a checkpoint without a manifest loads when named by its own path"
        )
    return (
        f"{path} is not a checkpoint: it has no {METADATA} or {MANIFEST} and no step_* checkpoint "
        "(an interrupted save leaves only a .tmp directory)"
    )


def resume(
    root: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest verified checkpoint under ``root`` (collective), as a restarted job does.

    Newer ``step_*`` folders that fail verification (a checksum mismatch, a missing file or
    ``.metadata``, no manifest) are skipped with a :class:`CheckpointWarning` each, on rank 0.

    Returns:
        (the checkpoint loaded, this rank's ``extra``), or None when ``root`` holds no verified
        checkpoint (nothing is changed then).

    Raises:
        CheckpointError: as :func:`load`, for the checkpoint chosen.
    """
    chosen = select.choose_together(Path(root))
    if chosen is None:
        return None
    _VERDICTS.clear()  # what this process wrote may have been damaged since: a start verifies afresh
    if chosen[1] is not None:  # verified: a later prune need not hash it again
        _remember(chosen[0], [])
    return chosen[0], _read_and_apply(*chosen, model, optimizer)


@outside_inference_mode
def _read_and_apply(
    directory: Path, manifest: Manifest | None, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Read every file of the (verified) checkpoint into copies, check them, then apply them.
    With inference mode off: torch's ``set_optimizer_state_dict`` keeps the copies as the
    optimizer's state, which the next ``optimizer.step()`` updates in place."""
    import torch.distributed.checkpoint as dcp

    rank = collectives.group_rank(collectives.default_group())
    action = f"load from {directory}"
    created: list[torch.Tensor] = []

    def prepare() -> dict[str, Any]:
        created.extend(create_optimizer_state(optimizer))
        target = copies(sharded(model, optimizer))  # a failed read must leave the model as it was
        saved = Reader(directory).read_metadata().state_dict_metadata
        check_fits(saved, target, optimizer, manifest.optimizer if manifest else None)
        return target

    def read(target: dict[str, Any]) -> dict[str, Any]:
        dcp.load(target, storage_reader=Reader(directory), checkpoint_id=str(directory))
        listed = manifest is None or extra_name(rank) in manifest.files
        return load_extra(directory, rank) if listed else {}

    # The checks run on their own before DCP's read: they may fail on some ranks only (a model
    # that differs on one rank), and a rank that went on into DCP's collectives would wait there
    # for a rank waiting in everywhere's exchange of errors.
    try:
        target = everywhere(action, prepare)
        extra = everywhere(action, lambda: read(target))
    except CheckpointError:
        forget_state(optimizer, created)
        raise
    everywhere(action, lambda: apply(model, optimizer, target))
    return extra


def verify(path: str | os.PathLike) -> list[str]:
    """Verify one checkpoint directory in this process: every file the manifest lists present,
    at its size, with its checksum.

    Returns:
        the problems, one per bad file, each naming the file, the rank that wrote it and what
        is wrong (``__1_0.distcp (written by rank 1): checksum mismatch``); empty when the
        checkpoint is verified. A checkpoint without a manifest gives one problem saying so.
    """
    directory = Path(path)
    manifest, problems = select.verify_here(directory)
    return [select.unverified_reason(directory)] if manifest is None and not problems else problems


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the model of a checkpoint as one full state dict (``.safetensors`` or ``.pt``).

    Runs in one process without a process group, after verifying the checkpoint (a folder of
    checkpoints gives its newest verified one, as :func:`load`). The result loads into the plain
    model with ``load_state_dict(..., strict=True)``.

    Raises:
        CheckpointError: ``path`` holds no verified checkpoint, or is one that fails verification.
        ValueError: ``out`` ends in neither ``.safetensors`` nor ``.pt``, or cannot be written
            (checked for its folder before the checkpoint is read).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = Path(out)
    if out.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"output {out} must end in .safetensors or .pt")
    if out.is_dir():
        raise ValueError(f"output {out} is a directory: give the path of a file in it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (out.parent, *out.parent.parents) if p.exists()), out.parent)
        why = f"{blocker} is a file, not a directory" if not blocker.is_dir() else e.strerror or str(e)
        raise ValueError(f"output {out}: its folder {out.parent} cannot be made: {why}") from None
    chosen = select.choose_here(Path(path))
    if chosen is None:
        raise CheckpointError(_nothing_to_load(Path(path)))
    directory = chosen[0]
    saved = Reader(directory).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in saved.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # that no_dist means one process is what is asked for here
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=Reader(directory), checkpoint_id=str(directory), no_dist=True)
    except (Exception, CheckpointException) as e:
        detail = "; ".join(text for _, text in reasons(e, 0))
        raise CheckpointError(f"checkpoint {directory} could not be read: {detail}") from e
    model = {k[len("model.") :]: v.contiguous() for k, v in state.items()}
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(model, str(out))
        else:
            torch.save(model, out)
    except (OSError, RuntimeError) as e:  # torch.save reports a missing folder as a RuntimeError
        raise ValueError(f"output {out} could not be written: {getattr(e, 'strerror', None) or e}") from None
    return out
