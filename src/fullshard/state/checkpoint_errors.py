"""How a checkpoint failure reaches the user: one line, on every rank, naming the rank and the cause.

A save or load is collective: when any rank fails, :func:`everywhere` raises
:class:`CheckpointError` on every rank, with one line such as::

    checkpoint save to /ckpt/step_00000002 failed on rank 1: No space left on device (writing __1_0.distcp)

torch.distributed.checkpoint reports a failure as ``CheckpointException ranks:dict_keys([1])``
followed by tracebacks; the real reason is inside it, per rank, and is taken out here. Failures
while reading or writing a file carry the file's name (:class:`FileFailure`).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from fullshard.comm import collectives

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank, naming the failed ranks.

    Attributes:
        failures: {rank: reason} for each rank that failed (empty when no rank was involved,
            e.g. a path that is not a checkpoint).
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into (the keys named)."""


class FileFailure(Exception):
    """Reading or writing one file of a checkpoint failed: ``REASON (writing NAME)``.

    Built by :meth:`of`; its one argument is the whole line, so it survives the pickling that
    torch.distributed.checkpoint gathers failures with.
    """

    @classmethod
    def of(cls, name: str, verb: str, cause: BaseException) -> FileFailure:
        """The failure of ``verb`` (``reading``, ``writing``) the file ``name`` because of ``cause``."""
        return cls(f"{one_line(cause)} ({verb} {name})")


def one_line(error: BaseException) -> str:
    """The reason of ``error`` on one line: an OSError's own words (``No space left on device``),
    fullshard's checkpoint errors as they are, anything else as ``Type: message``."""
    if isinstance(error, OSError) and error.strerror:
        text = error.strerror + (f" ({error.filename})" if error.filename else "")
    elif isinstance(error, (FileFailure, CheckpointMismatch, CheckpointError)):
        text = str(error)
    elif isinstance(error, EOFError) and not str(error):
        text = "EOFError: the file ends early"
    else:
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def reasons(error: BaseException, rank: int) -> list[tuple[int, str]]:
    """(failed rank, one-line reason) pairs of ``error`` raised on ``rank``: a
    torch.distributed.checkpoint CheckpointException is unwrapped into each rank's own failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        out: list[tuple[int, str]] = []
        for failed, wrapped in sorted(error.failures.items()):
            cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            out += reasons(cause, failed) if isinstance(cause, BaseException) else [(failed, str(cause))]
        return out
    if isinstance(error, CheckpointError) and error.failures:
        return sorted(error.failures.items())
    return [(rank, one_line(error))]


def failure_line(action: str, pairs: list[tuple[int, str]]) -> str:
    """``checkpoint ACTION failed on rank R: REASON``; ranks with the same reason share one
    clause (``ranks 0 and 1: ...``), different reasons are joined by ``; on rank ...``."""
    by_reason: dict[str, list[int]] = {}
    for r, text in sorted(set(pairs)):
        by_reason.setdefault(text, []).append(r)
    clauses = []
    for text, ranks in sorted(by_reason.items(), key=lambda kv: kv[1][0]):
        if len(ranks) == 1:
            who = f"rank {ranks[0]}"
        else:
            who = f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
        clauses.append(f"{who}: {text}")
    return f"checkpoint {action} failed on " + "; on ".join(clauses)


def everywhere(action: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails on any, raise CheckpointError on all (collective).

    Raises:
        CheckpointError: on every rank, one line naming each failed rank and its reason.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        error = e
    group = collectives.default_group()
    rank = collectives.group_rank(group)
    flag = torch.tensor([1.0 if error is not None else 0.0])
    collectives.all_reduce_max(flag, group)
    if flag.item():
        gathered = collectives.all_gather_object([] if error is None else reasons(error, rank), group)
        pairs = [(int(r), str(t)) for part in gathered for r, t in part]
        failures: dict[int, str] = {}
        for r, text in sorted(set(pairs)):
            failures[r] = f"{failures[r]}; {text}" if r in failures else text
        raise CheckpointError(failure_line(action, pairs), failures) from error
    return result
