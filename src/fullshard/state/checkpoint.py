"""Sharded checkpoints on torch.distributed.checkpoint: atomic, resharding, and safe to crash in.

Layout: ``ROOT/step_00000120/`` holds one checkpoint: DCP's files (every rank writes its shards,
rank 0 writes ``.metadata`` last) and ``extra_rank{r}.pt`` (each rank's own extra state, such
as RNG states). A save writes into ``step_00000120.tmp/`` and renames it when every rank is
done, so a directory without ``.tmp`` is complete: a crash during a save leaves the previous
checkpoint as the newest complete one. ``keep`` prunes older complete checkpoints.

``ROOT`` may be shared by all ranks (rank 0 renames the directory) or local to each rank or
node (each directory's lowest rank renames it): then every rank's directory holds its own
shards and rank 0's the metadata, and merging the directories (as Ray Train does with the
directories its workers report) gives one complete checkpoint.

The model and optimizer state are sharded state dicts (DTensor ``Shard(0)`` entries), so a
checkpoint saved at one world size loads at any other. Errors on any rank are raised on every
rank as :class:`CheckpointError`, naming the rank and the problem; nothing hangs, and a model
is never left partly loaded by a load that reports success.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from fullshard.comm import collectives, flight_recorder
from fullshard.engine.config import FrontEnd
from fullshard.engine.hooks import UnitHooks, fsdp_state
from fullshard.state.optim_state import init_state, load_sharded_optim_state_dict, sharded_optim_state_dict
from fullshard.state.state_dict import load_sharded_state_dict, sharded_state_dict

_STEP = re.compile(r"^step_(\d{8})$")
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank with every rank's reason."""


def _everywhere(action: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails on any, raise CheckpointError on all (collective)."""
    error: BaseException | None = None
    result: Any = None
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        result = fn()
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        error = e
    group = collectives.default_group()
    flag = torch.tensor([1.0 if error is not None else 0.0])
    collectives.all_reduce_max(flag, group)
    if flag.item():
        reasons = collectives.all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group)
        detail = "; ".join(f"rank {r}: {m}" for r, m in enumerate(reasons) if m)
        raise CheckpointError(f"{action} failed: {detail}") from error
    return result


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
    """The newest complete checkpoint directory under ``root`` (None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / ".metadata").is_file()
    )
    return steps[-1][1] if steps else None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The sharded state to save or load into: DTensor shards under the original names.

    A ``fully_shard`` model already registers DTensor parameters, so torch's own
    ``get_model_state_dict`` / ``get_optimizer_state_dict`` give it; the FSDP1 wrapper maps
    its plain shards itself. Both write the same keys, so ``convert`` reads either.

    Raises:
        TypeError: ``model`` heads no unit of either front end.
    """
    hooks = _hook_state(model)
    if hooks.front_end is FrontEnd.FULLY_SHARD:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        return state
    state = {"model": sharded_state_dict(model, hooks.ignored)}
    if optimizer is not None:
        state["optim"] = sharded_optim_state_dict(model, optimizer)
    return state


def _hook_state(model: nn.Module) -> UnitHooks:
    """The hook state of the unit ``model`` heads (which front end built it, what it ignores).

    Raises:
        TypeError: ``model`` heads no unit.
    """
    state = fsdp_state(model) if isinstance(model, nn.Module) else None
    if state is None:
        raise TypeError(
            "model must be the root FullyShardedDataParallel or a module given to fully_shard, got "
            f"{type(model).__name__}"
        )
    return state


def _apply(model: nn.Module, optimizer: torch.optim.Optimizer | None, target: dict[str, Any]) -> None:
    """Copy the loaded sharded state into the model and optimizer."""
    hooks = _hook_state(model)
    if hooks.front_end is FrontEnd.FULLY_SHARD:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(model, target["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, target["optim"])
        return
    load_sharded_state_dict(model, target["model"], True, hooks.ignored)
    if optimizer is not None:
        load_sharded_optim_state_dict(model, optimizer, target["optim"])


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
        keep: keep only this many newest complete checkpoints (None: all).

    Returns:
        the directory of the new, complete checkpoint.

    Raises:
        CheckpointError: on every rank, when any rank failed; the previous checkpoints stay.
    """
    import torch.distributed.checkpoint as dcp

    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = collectives.group_rank(collectives.default_group())
    leader = _claim(tmp, f"save to {final}")

    def gather_state() -> dict[str, Any]:
        torch.save(extra or {}, tmp / f"extra_rank{rank}.pt")
        return _state(model, optimizer)

    state = _everywhere(f"save to {final}", gather_state)
    # Inside dcp.save a failure on one rank reaches every rank through DCP's own collectives,
    # so all ranks leave it together and meet again in _everywhere.
    _everywhere(f"save to {final}", lambda: dcp.save(state, checkpoint_id=str(tmp)))

    def publish() -> None:
        if rank == leader:
            for claim in tmp.glob(f"{_CLAIM}*"):
                claim.unlink()
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _prune(Path(root), keep)

    _everywhere(f"save to {final}", publish)
    return final


_CLAIM = ".fullshard-claim-"


def _claim(tmp: Path, action: str) -> int:
    """Prepare the temporary directory ``tmp`` of a save; return the rank that publishes it.

    ``tmp`` may be one directory every rank sees (a shared file system) or a directory per rank
    or per node (Ray Train's idiom: each worker saves into its own local directory and Ray merges
    them). Every rank creates ``tmp`` and leaves a claim file with this save's token in it; the
    lowest rank whose claim a rank sees is that directory's leader, which empties it of anything
    older (an interrupted save) and later renames it. Collective; a failure on any rank raises
    CheckpointError on all.
    """
    import uuid

    group = collectives.default_group()
    rank = collectives.group_rank(group)
    token = collectives.broadcast_object(uuid.uuid4().hex if rank == 0 else None, 0, group)
    mine = f"{_CLAIM}{token}-"

    def create() -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / f"{mine}{rank}").touch()

    _everywhere(action, create)  # its closing all-reduce is the barrier: every claim is written

    def clean() -> int:
        leader = min(int(p.name[len(mine) :]) for p in tmp.glob(f"{mine}*"))
        if rank == leader:
            for p in tmp.iterdir():
                if not p.name.startswith(mine):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        return leader

    return _everywhere(action, clean)


def _prune(root: Path, keep: int | None) -> None:
    if keep is None:
        return
    # A published directory is complete; in a per-rank directory only rank 0's holds .metadata.
    complete = sorted(p for p in root.iterdir() if _STEP.match(p.name))
    for old in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


@flight_recorder.labelled("checkpoint load")
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``), at any world size (collective).

    Args:
        path: a checkpoint directory, or a folder of them (its newest complete one is loaded).

    Returns:
        this rank's ``extra`` from the save (empty when it was saved by no rank of this number).

    Raises:
        CheckpointError: on every rank: no checkpoint at ``path``; missing or unexpected keys or
            a shape mismatch (named); unreadable files. The model is unchanged then.
    """
    import torch.distributed.checkpoint as dcp

    rank = collectives.group_rank(collectives.default_group())
    directory = _resolve(Path(path))

    def read() -> dict[str, Any]:
        if optimizer is not None:
            init_state(optimizer)
        target = _copies(_state(model, optimizer))  # a failed read must leave the model as it was
        _check_against(directory, target)
        dcp.load(target, checkpoint_id=str(directory))
        return target

    target = _everywhere(f"load from {directory}", read)

    def apply() -> dict[str, Any]:
        _apply(model, optimizer, target)
        extra = directory / f"extra_rank{rank}.pt"
        return torch.load(extra, weights_only=False) if extra.is_file() else {}

    return _everywhere(f"load from {directory}", apply)


def _copies(state: Any) -> Any:
    """The same nested state with every tensor (and DTensor shard) copied."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _copies(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copies(v) for v in state]
    if isinstance(state, DTensor):
        return DTensor.from_local(
            state.to_local().clone(),
            state.device_mesh,
            state.placements,
            run_check=False,
            shape=state.size(),
            stride=state.stride(),
        )
    if isinstance(state, torch.Tensor):
        return state.clone()
    return state


def _resolve(path: Path) -> Path:
    if (path / ".metadata").is_file():
        return path
    newest = latest(path)
    if newest is not None:
        return newest
    raise CheckpointError(
        f"{path} is not a checkpoint: it has no .metadata and no complete step_* checkpoint "
        "(an interrupted save leaves only a .tmp directory)"
    )


def _check_against(directory: Path, target: dict[str, Any]) -> None:
    """Compare the checkpoint's keys and shapes with what the model expects; name any mismatch."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    wanted: dict[str, Any] = {}
    for name, value in target["model"].items():
        wanted[f"model.{name}"] = value
    saved_model = {k for k in saved if k.startswith("model.")}
    missing = sorted(set(wanted) - saved_model)
    unexpected = sorted(saved_model - set(wanted))
    problems = []
    if missing:
        problems.append(f"missing key(s) {', '.join(k[6:] for k in missing)}")
    if unexpected:
        problems.append(f"unexpected key(s) {', '.join(k[6:] for k in unexpected)}")
    for key, value in wanted.items():
        meta = saved.get(key)
        if isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            shape = value.shape if not isinstance(value, DTensor) else value.size()
            if tuple(meta.size) != tuple(shape):
                problems.append(f"shape mismatch for {key[6:]}: checkpoint {tuple(meta.size)}, model {tuple(shape)}")
    if "optim" in target and not any(k.startswith("optim.") for k in saved):
        problems.append("the checkpoint holds no optimizer state")
    if problems:
        raise ValueError(f"checkpoint {directory} does not fit the model: " + "; ".join(problems))


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the model of a checkpoint as one full state dict (``.safetensors`` or ``.pt``).

    Runs in one process without a process group. The result loads into the plain model with
    ``load_state_dict(..., strict=True)``.

    Raises:
        CheckpointError: ``path`` holds no complete checkpoint.
        ValueError: ``out`` ends in neither ``.safetensors`` nor ``.pt``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = Path(out)
    if out.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"output {out} must end in .safetensors or .pt")
    directory = _resolve(Path(path))
    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in saved.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    model = {k[len("model.") :]: v.contiguous() for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(model, str(out))
    else:
        torch.save(model, out)
    return out
