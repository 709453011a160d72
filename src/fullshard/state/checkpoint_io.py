"""A checkpoint's files: torch.distributed.checkpoint's file-system storage, told which files it
wrote and which file a failure happened in, and each rank's own ``extra_rank{r}.pt``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from fullshard.state.checkpoint_errors import FileFailure


def extra_name(rank: int) -> str:
    """The file of rank ``rank``'s own extra state in a checkpoint."""
    return f"extra_rank{rank}.pt"


class _Recording:
    """A file being written, remembering the OSError its ``write`` raised: torch.save's zip
    writer turns that into ``RuntimeError: [enforce fail ...] unexpected pos``, losing the errno
    (``No space left on device``)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.error: OSError | None = None

    def write(self, data: Any) -> Any:
        try:
            return self._stream.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _NamingFileSystem(FileSystem):
    """DCP's local file system; an error while a file is open is re-raised as FileFailure naming
    it, with the OSError beneath a write failure as its reason."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        recording: _Recording | None = None
        try:
            with super().create_stream(path, mode) as stream:
                if "r" in mode:
                    yield stream
                else:
                    recording = _Recording(stream)
                    yield recording
        except FileFailure:
            raise
        except Exception as e:
            lost = recording.error if recording is not None and not isinstance(e, OSError) else None
            raise FileFailure.of(Path(path).name, "reading" if "r" in mode else "writing", lost or e) from e


class Writer(FileSystemWriter):
    """torch.distributed.checkpoint's file writer (one file per rank, synced), which remembers
    the files this rank wrote (:attr:`written`) and names the file a write failed in."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _NamingFileSystem()
        self.written: set[str] = set()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written |= {result.storage_data.relative_path for result in future.value()}
        return future


class Reader(FileSystemReader):
    """torch.distributed.checkpoint's file reader, naming the file a read failed in."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _NamingFileSystem()


def save_extra(directory: Path, rank: int, extra: dict[str, Any]) -> str:
    """Write this rank's extra state into ``directory``; return the file's name.

    Raises:
        FileFailure: it could not be written (the reason and the file named).
    """
    name = extra_name(rank)
    try:
        torch.save(extra, directory / name)
    except Exception as e:
        raise FileFailure.of(name, "writing", e) from e
    return name


def load_extra(directory: Path, rank: int) -> dict[str, Any]:
    """This rank's extra state from ``directory`` (empty when the checkpoint has none for it).

    Raises:
        FileFailure: the file exists but cannot be read (truncated, damaged).
    """
    path = directory / extra_name(rank)
    if not path.is_file():
        return {}
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:
        raise FileFailure.of(path.name, "reading", e) from e
