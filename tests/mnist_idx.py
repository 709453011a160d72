"""MNIST as IDX files for job tests that need less data than the shipped subset."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from fullshard.jobs.data.mnist import BUNDLED, TRAIN_PER_CLASS


def train_subset(folder: Path, fraction: float = 0.5, test_fraction: float = 1.0) -> Path:
    """The shipped subset as the four IDX files with ``fraction`` of its training images (the
    first of each digit, shuffled; 0.5: 200 per digit) and ``test_fraction`` of its 1,000 test
    images; ``folder`` is created if need be."""
    folder.mkdir(parents=True, exist_ok=True)
    with np.load(BUNDLED) as z:
        images, labels = z["images"], z["labels"]
    per_class = int(TRAIN_PER_CLASS * fraction)
    train = np.random.default_rng(0).permutation(
        np.concatenate([np.flatnonzero(labels == d)[:per_class] for d in range(10)])
    )
    digit = [np.flatnonzero(labels == d)[TRAIN_PER_CLASS:] for d in range(10)]
    test = np.concatenate([idx[: int(len(idx) * test_fraction)] for idx in digit])
    for name, array in {
        "train-images-idx3-ubyte": images[train],
        "train-labels-idx1-ubyte": labels[train],
        "t10k-images-idx3-ubyte": images[test],
        "t10k-labels-idx1-ubyte": labels[test],
    }.items():
        header = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        (folder / name).write_bytes(header + array.astype(np.uint8).tobytes())
    return folder
