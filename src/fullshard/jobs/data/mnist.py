"""MNIST data for the training job: the standard IDX files, or the subset shipped in the package.

Images come out as float32 tensors of shape (n, 1, 28, 28), normalized with MNIST's mean
0.1307 and standard deviation 0.3081 (as the PyTorch tutorial does); labels as int64 (n,).
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

MEAN, STD = 0.1307, 0.3081
_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
BUNDLED = Path(__file__).parent / "mnist_5k.npz"
TRAIN_PER_CLASS = 400


def _read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally .gz) into a uint8 array of its declared shape.

    Raises:
        ValueError: the file is not a uint8 IDX file.
    """
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path} is not a uint8 IDX file (bad magic number)")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} values (truncated?)")
    return data.reshape(dims)


def _find(data_dir: Path, stem: str) -> Path | None:
    for folder in (data_dir, data_dir / "MNIST" / "raw", data_dir / "raw"):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def _to_dataset(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
    x = torch.from_numpy(images.astype(np.float32) / 255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def find_idx_files(data_dir: str | Path) -> dict[str, Path]:
    """Paths of the four standard MNIST IDX files in ``data_dir``.

    Looks in ``data_dir``, ``data_dir/MNIST/raw`` (torchvision's layout) and ``data_dir/raw``,
    for each file plain or gzipped.

    Raises:
        FileNotFoundError: a file is missing; the message lists what is expected and where.
    """
    root = Path(data_dir)
    found = {key: _find(root, stem) for key, stem in _FILES.items()}
    missing = [_FILES[k] for k, v in found.items() if v is None]
    if missing:
        raise FileNotFoundError(
            f"--data-dir {root}: no MNIST file(s) {', '.join(missing)} (plain or .gz) in {root}, "
            f"{root / 'MNIST' / 'raw'} or {root / 'raw'}; put the four IDX files there, or leave "
            "out --data-dir to use the 5,000-image subset shipped with fullshard"
        )
    return {k: v for k, v in found.items() if v is not None}


def load_idx(data_dir: str | Path) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets from the four standard MNIST IDX files in ``data_dir``.

    Raises:
        FileNotFoundError: a file is missing (see :func:`find_idx_files`).
        ValueError: a file is not a valid uint8 IDX file.
    """
    arrays = {k: _read_idx(v) for k, v in find_idx_files(data_dir).items()}
    return (
        _to_dataset(arrays["train_images"], arrays["train_labels"]),
        _to_dataset(arrays["test_images"], arrays["test_labels"]),
    )


def load_bundled() -> tuple[TensorDataset, TensorDataset]:
    """The shipped subset split 4,000 / 1,000: per digit, the first 400 train, the last 100 test."""
    with np.load(BUNDLED) as z:
        images, labels = z["images"], z["labels"]
    train_idx, test_idx = [], []
    for digit in range(10):
        idx = np.flatnonzero(labels == digit)
        train_idx.append(idx[:TRAIN_PER_CLASS])
        test_idx.append(idx[TRAIN_PER_CLASS:])
    tr, te = np.concatenate(train_idx), np.concatenate(test_idx)
    return _to_dataset(images[tr], labels[tr]), _to_dataset(images[te], labels[te])


def load(data_dir: str | Path | None) -> tuple[TensorDataset, TensorDataset]:
    """``load_idx(data_dir)`` when given, else ``load_bundled()``."""
    return load_idx(data_dir) if data_dir else load_bundled()
