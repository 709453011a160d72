"""MNIST as IDX files for job tests that need less data than the shipped subset."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from fullshard.jobs.data.mnist import BUNDLED, TRAIN_PER_CLASS


def half_train_set(folder: Path) -> Path:
    """The shipped subset as the four IDX files, with half its training images (200 per digit,
    shuffled) and all 1,000 test images; ``folder`` is created if need be."""
    folder.mkdir(parents=True, exist_ok=True)
    with np.load(BUNDLED) as z:
        images, labels = z["images"], z["labels"]
    train = np.random.default_rng(0).permutation(
        np.concatenate([np.flatnonzero(labels == d)[: TRAIN_PER_CLASS // 2] for d in range(10)])
    )
    test = np.concatenate([np.flatnonzero(labels == d)[TRAIN_PER_CLASS:] for d in range(10)])
    for name, array in {
        "train-images-idx3-ubyte": images[train],
        "train-labels-idx1-ubyte": labels[train],
        "t10k-images-idx3-ubyte": images[test],
        "t10k-labels-idx1-ubyte": labels[test],
    }.items():
        header = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        (folder / name).write_bytes(header + array.astype(np.uint8).tobytes())
    return folder
