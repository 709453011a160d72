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


def split_sizes(files: list[Path]) -> tuple[int, int]:
    """(training bytes, validation bytes) that :meth:`ByteCorpus.load` makes of ``files``,
    from their sizes alone (nothing read): what a job checks before its workers start."""
    sizes = [p.stat().st_size for p in files]
    train = [n for i, n in enumerate(sizes) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [n for i, n in enumerate(sizes) if i % VAL_EVERY == VAL_EVERY - 1]
    if not val:  # load() holds out the tail of the last file
        last = train.pop()
        cut = max(1, last * 9 // 10)
        train.append(min(cut, last))
        val.append(max(0, last - cut))
    return _joined(train), _joined(val)


def _joined(sizes: list[int]) -> int:
    return sum(sizes) + max(0, len(sizes) - 1)  # the parts are joined by a newline


def check_fits(pattern: str, seq_len: int) -> None:
    """Check that the corpus of ``pattern`` has a window of ``seq_len`` + 1 bytes in both parts.

    Raises:
        ValueError: naming the bytes each part has and the window it needs.
        FileNotFoundError: ``pattern`` matches nothing.
    """
    files = files_from_glob(pattern)
    train, val = split_sizes(files)
    need = seq_len + 2
    if train < need or val < need:
        total = sum(p.stat().st_size for p in files)
        raise ValueError(
            f"--data {pattern!r}: {total} bytes of text in {len(files)} file(s) give {train} training and {val} "
            f"validation bytes; --seq-len {seq_len} needs at least {need} in each (every 20th file is validation, "
            "or the last tenth of a single file): give more text or a smaller --seq-len"
        )


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
