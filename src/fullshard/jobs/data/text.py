"""Byte-level text data for the GPT job: a corpus of UTF-8 files as one uint8 stream.

The default corpus is the running interpreter's standard library sources (``*.py`` under
``sysconfig``'s stdlib path, without its ``test``/``tests`` packages and site-packages), which
every machine with Python has. Files are read in sorted order; every 20th file (by that order)
is validation, the rest training, so the split is fixed for a given interpreter.

Batches are drawn by step: the windows for (step, rank) come from a generator seeded with
(seed, step, rank), so any step's batch can be drawn again, which exact resume relies on.
"""

from __future__ import annotations

import dataclasses
import glob
import sysconfig
from pathlib import Path

import numpy as np
import torch

VAL_EVERY = 20


def default_files() -> list[Path]:
    """The standard library's own ``.py`` sources, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def files_from_glob(pattern: str) -> list[Path]:
    """Files matching ``pattern`` (``**`` allowed), sorted.

    Raises:
        FileNotFoundError: nothing matches.
    """
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise FileNotFoundError(
            f"--data {pattern!r} matches no files; give a glob of UTF-8 text files, e.g. 'corpus/**/*.txt'"
        )
    return files


@dataclasses.dataclass
class ByteCorpus:
    """Training and validation bytes as uint8 tensors of shape (n,)."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, pattern: str | None = None) -> ByteCorpus:
        """Read the files of ``pattern`` (default: the stdlib sources) and split them.

        Raises:
            FileNotFoundError: ``pattern`` matches nothing.
            ValueError: either part is too small to draw a window from.
        """
        files = files_from_glob(pattern) if pattern else default_files()
        train: list[bytes] = []
        val: list[bytes] = []
        for i, path in enumerate(files):
            (val if i % VAL_EVERY == VAL_EVERY - 1 else train).append(path.read_bytes())
        if not val:  # a handful of files: hold out the tail of the last one
            last = train.pop()
            cut = max(1, len(last) * 9 // 10)
            train.append(last[:cut])
            val.append(last[cut:])
        return cls(_as_tensor(train), _as_tensor(val))

    def batch(
        self, step: int, rank: int, batch_size: int, seq_len: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training inputs and next-byte targets for (step, rank), each int64 (batch_size, seq_len).

        Raises:
            ValueError: the training bytes are shorter than one window.
        """
        return _windows(self.train, batch_size, seq_len, _seed(seed, step, rank))

    def val_batches(
        self, count: int, batch_size: int, seq_len: int, seed: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` fixed validation batches (the same on every rank and every call)."""
        return [_windows(self.val, batch_size, seq_len, _seed(seed, -1 - i, 0)) for i in range(count)]


def _as_tensor(parts: list[bytes]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b"\n".join(parts), dtype=np.uint8).copy())


def _seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63)


def _windows(data: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if data.numel() < seq_len + 2:
        raise ValueError(f"corpus part of {data.numel()} bytes is shorter than one window of --seq-len {seq_len} + 1")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=g)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]
