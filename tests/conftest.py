import fcntl
import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ray_exclusive():
    """One local Ray instance at a time on this machine (pytest-xdist runs test files in two
    workers): a file lock around each test that starts Ray."""
    with open(os.path.join(tempfile.gettempdir(), "fullshard-tests-ray.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
