"""Convert ../shared/data/mnist_5k.csv.gz into src/fullshard/jobs/data/mnist_5k.npz (run once).

The CSV holds one image a line: 784 pixel values 0-255 then the label. The .npz holds
``images`` (uint8, shape (5000, 28, 28)) and ``labels`` (uint8, shape (5000,)) in the CSV's
order (sorted by label, 500 of each digit).
"""

import gzip
import hashlib
import sys
from pathlib import Path

import numpy as np


def main(src: str, dst: str) -> None:
    raw = Path(src).read_bytes()
    rows = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.uint8)
    images = rows[:, :784].reshape(-1, 28, 28)
    labels = rows[:, 784]
    np.savez_compressed(dst, images=images, labels=labels)
    print(f"{src} (sha256 {hashlib.sha256(raw).hexdigest()}) -> {dst}: {images.shape} {labels.shape}")


if __name__ == "__main__":
    main(*(sys.argv[1:] or ["../shared/data/mnist_5k.csv.gz", "src/fullshard/jobs/data/mnist_5k.npz"]))
