"""Datasets of the training jobs: the bundled MNIST subset (and IDX files), text corpora."""
