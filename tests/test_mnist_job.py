"""The main job on real data: `fullshard train mnist`, launched by fullshard and by torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mnist_idx import train_subset

BIN = Path(sys.executable).parent


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(500)
def test_mnist_default_recipe_two_processes_reach_094_in_three_epochs(tmp_path: Path) -> None:
    """The default recipe (batch 64, Adadelta lr 1.0, StepLR 0.7) at --nproc 2, three of its ten
    epochs (the suite's time; 0.962 measured, 0.932 after two; all ten, `make demo`, reach 0.956
    as NOTES.md says); the model saved loads plainly."""
    from fullshard.jobs.train.mnist import MnistConfig, parse_args

    assert parse_args([]) == MnistConfig(nproc=parse_args([]).nproc)  # the defaults are the dataclass's
    assert (MnistConfig.epochs, MnistConfig.batch_size, MnistConfig.lr, MnistConfig.gamma) == (10, 64, 1.0, 0.7)
    metrics, saved = tmp_path / "m2.jsonl", tmp_path / "net.pt"
    r = _run(
        [
            str(BIN / "fullshard"),
            "train",
            "mnist",
            "--nproc",
            "2",
            "--epochs",
            "3",
            "--metrics-file",
            str(metrics),
            "--save-model",
            str(saved),
        ],
        tmp_path,
        timeout=480,
    )
    two = _records(metrics)
    assert [rec["epoch"] for rec in two] == [1, 2, 3]
    assert two[-1]["test_accuracy"] >= 0.94, two[-1]
    assert [rec["lr"] for rec in two] == pytest.approx([1.0, 0.7, 0.49])
    assert all(rec["grad_norm"] > 0 and rec["samples_per_second"] > 0 and 0 < rec["mfu"] < 1 for rec in two)
    for key in ("train_loss", "test_loss", "epoch_seconds"):
        assert two[-1][key] > 0
    assert len(two[-1]["peak_rss_bytes"]) == 2 and min(two[-1]["peak_rss_bytes"]) > 0
    # fc1 is its own unit: the wrapped model is printed once, by rank 0.
    assert r.stdout.count("FullyShardedDataParallel(\n  (_fsdp_wrapped_module): Net(") == 1
    assert "(fc1): FullyShardedDataParallel(" in r.stdout
    assert "final test accuracy" in r.stdout

    from fullshard.jobs.models.net import Net

    net = Net()
    net.load_state_dict(torch.load(saved), strict=True)

    # Each rank holds half of the fp32 parameters, their gradients and Adadelta's two buffers
    # (16 bytes per parameter in all; FSDP pads each unit's flat parameter to an even length).
    numel = sum(p.numel() for p in net.parameters())
    for per_rank in two[-1]["sharded_state_bytes"]:
        assert per_rank == pytest.approx(16 * numel / 2, rel=1e-4), (per_rank, numel)


@pytest.mark.timeout(300)
def test_mnist_under_torchrun_bf16_learns_in_one_epoch_of_an_eighth_of_the_data(tmp_path: Path) -> None:
    """The job under torchrun (ranks from torchrun's environment), with --mixed-precision bf16
    (bf16 all-gathers and compute, fp32 shards), --forward-prefetch and shard_grad_op in one run.
    This CPU has no bf16 convolution kernel (torch falls back to a slow one, 8.5x float32's time),
    so the suite trains one epoch on an eighth of the training images (500, given as IDX files
    by --data-dir; 200 test images): 0.635 measured (27 s), bar 0.45 (chance: 0.1); a quarter
    of the images gave 0.714. On the whole subset the runs measured 0.935, 0.956, 0.965 after
    epochs 1-3, 0.969 after 10."""
    metrics = tmp_path / "bf16.jsonl"
    _run(
        # --standalone: a free rendezvous port (the default 29500 may still be held by an earlier run)
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fullshard.train",
            "mnist",
            "--epochs",
            "1",
            "--sharding-strategy",
            "shard_grad_op",
            "--mixed-precision",
            "bf16",
            "--forward-prefetch",
            "--data-dir",
            str(train_subset(tmp_path / "data", 0.125, 0.2)),
            "--metrics-file",
            str(metrics),
        ],
        tmp_path,
        timeout=280,
    )
    (last,) = _records(metrics)
    assert last["epoch"] == 1 and last["test_accuracy"] >= 0.45, last
    assert len(last["sharded_state_bytes"]) == 2, last
