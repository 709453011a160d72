"""The main job on real data: `fullshard train mnist`, launched by fullshard and by torchrun."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist import patched, run_ranks
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


class _Noted(torch.utils.data.Dataset):
    """A training set that notes the index of every image it hands out, in order."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner, self.seen = inner, []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(i)
        return self.inner[i]


def mnist_body(rank: int, world: int, argv: list[str]) -> tuple[dict | None, str, list[int]]:
    """The job's ranks in kept test ranks (no launcher): rank 0's record, what the rank printed,
    and the training images it trained, in order."""
    from fullshard.jobs.data import mnist as mnist_data
    from fullshard.jobs.train import mnist

    real, noted = mnist_data.load, []

    def load(data_dir: str | None) -> tuple[_Noted, torch.utils.data.Dataset]:
        train, test = real(data_dir)
        noted.append(_Noted(train))
        return noted[0], test

    out = io.StringIO()
    with patched(mnist_data, load=load), contextlib.redirect_stdout(out):
        record = mnist._run(mnist.parse_args(["--nproc", str(world), *argv]), torch.device("cpu"))
    return record, out.getvalue(), noted[0].seen


def _train(tmp: Path, nproc: int, ckpt: str, *more: str) -> tuple[dict, str, list[list[int]]]:
    """One epoch on ``tmp/data`` (1,000 training images) at ``nproc`` ranks: rank 0's record and
    output, and each rank's images in the order trained."""
    args = ["--epochs", "1", "--data-dir", str(tmp / "data"), "--checkpoint-dir", str(tmp / ckpt), "--no-progress"]
    ranks = run_ranks(mnist_body, nproc, [*args, *more], timeout=200)
    return ranks[0][0], ranks[0][1], [seen for _, _, seen in ranks]


@pytest.mark.timeout(600)
def test_mnist_resumes_at_other_world_sizes_with_the_samples_not_yet_trained(tmp_path: Path) -> None:
    """A 2-rank epoch of 1,000 images (8 steps of 64 per rank) saves at steps 4 (512 samples of
    the epoch's order trained) and 8 (the epoch's end). Resumed from step 4 at 1 rank, the epoch
    trains the other 488, each once (8 steps; it trained the 1-rank order's batches 4-15:
    repeats and omissions); at 3 ranks too, 163 per rank, one image twice as padding. Rank 2 did
    not exist at the save and continues where ranks 0 and 1 do (it crashed). Resumed from step 8
    at 3 ranks, nothing is left to train: the epoch's record is the 2-rank run's, and its
    throughput that of this run, 0 (it was the restored samples over the time of the test set)."""
    train_subset(tmp_path / "data", 0.25, 0.2)
    ref, _, ref_seen = _train(tmp_path, 2, "c2", "--checkpoint-every", "4")
    assert sorted(i for seen in ref_seen for i in seen) == list(range(1000))
    before = [i for seen in ref_seen for i in seen[: 4 * 64]]  # what the checkpoint of step 4 trained
    for name, step, nproc in (("a3", 4, 3), ("a1", 4, 1), ("b3", 8, 3)):
        saved = f"step_{step:08d}"
        shutil.copytree(tmp_path / "c2" / saved, tmp_path / name / saved)
        rec, out, seen = _train(tmp_path, nproc, name)
        if step == 4:
            count = collections.Counter(before + [i for s in seen for i in s])
            assert sorted(count) == list(range(1000)), f"{1000 - len(count)} images left out"
            assert sum(count.values()) == (1000 if nproc == 1 else 1001), f"{sum(count.values())} handed out"
            assert len({len(s) for s in seen}) == 1, [len(s) for s in seen]  # the same steps on every rank
        at = 512 if step == 4 else 1000
        assert f"{saved} at epoch 1, sample {at} of its order (saved at 2 ranks)" in out, out[-2000:]
        assert len(rec["peak_rss_bytes"]) == nproc, rec
        if step == 4:
            assert rec["train_samples"] == sum(count.values()), rec
            assert rec["samples_per_second"] > 0 and 0 < rec["mfu"] < 1 and rec["train_loss"] > 0, rec
        else:
            assert seen == [[]] * nproc
            for key in ("train_loss", "train_samples", "grad_norm", "lr"):
                assert rec[key] == pytest.approx(ref[key], rel=1e-12), key
            assert rec["samples_per_second"] == 0 and rec["mfu"] == 0, rec
    assert ref["train_samples"] == 1000 and ref["samples_per_second"] > 0, ref


def _past_epochs_body(rank: int, world: int) -> str:
    """``mnist._resume`` on a stand-in session whose checkpoint is in epoch 3, with --epochs 2."""
    from torch.optim.lr_scheduler import StepLR

    from fullshard.jobs.train import mnist
    from fullshard.jobs.train.session import Resumed

    class Saved:
        def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Resumed:
            position = {"epoch": 3, "sample": 320, "step": 65, "stats": [0.0, 0.0], "world": 1}
            extra = {"rng": None, "position": {**position, "scheduler": StepLR(optimizer, 1).state_dict()}}
            return Resumed(65, extra, "ckpt/step_00000065")

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adadelta(model.parameters())
    with pytest.raises(ValueError, match=r"--epochs 2 is below the epoch of the checkpoint resumed from, 3 ") as e:
        mnist._resume(Saved(), model, optimizer, StepLR(optimizer, 1), 64, 2)  # type: ignore[arg-type]
    return str(e.value)


@pytest.mark.timeout(120)
def test_epochs_below_the_checkpoints_epoch_are_refused() -> None:
    """A checkpoint in epoch 3 and ``--epochs 2``: the job trained nothing and exited 0 without a
    word; now the resume refuses, naming --epochs (one kept test rank; the session is a stand-in)."""
    assert "--epochs 3 or more" in run_ranks(_past_epochs_body, 1, timeout=100)[0]


def test_mnist_rejects_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Values the workers took (a negative or NaN --gamma, a negative --min-num-params) or failed
    on with torch's wording (--lr -1), and an output path under a file: one line, exit status 2,
    before any worker starts."""
    from fullshard.jobs.train.mnist import parse_args

    afile = tmp_path / "afile"
    afile.write_text("")
    for args, text in (
        (["--lr", "-1"], "--lr -1.0: give a positive, finite learning rate"),
        (["--lr", "inf"], "--lr inf: give a positive, finite learning rate"),
        (["--gamma", "-1"], "--gamma -1.0: give the lr's positive factor per epoch"),
        (["--gamma", "nan"], "--gamma nan: give the lr's positive factor per epoch"),
        (["--min-num-params", "-5"], "--min-num-params -5: give a parameter count, 0 or more"),
        (["--save-model", str(afile / "net.pt")], f"--save-model {afile / 'net.pt'}: {afile} is a file, not a"),
        (["--metrics-file", str(afile / "m.jsonl")], f"--metrics-file {afile / 'm.jsonl'}: {afile} is a file"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and text in err and err.count("\n") == 1, err


@pytest.mark.timeout(200)
def test_int8_gradients_resume_exactly(tmp_path: Path) -> None:
    """``--comm-quant int8``: resumed at step 4 of 8 (a quarter of the training images, one
    epoch), the run ends bitwise equal to the uninterrupted one; each new process reseeded the
    stochastic rounding, and 8 tensors differed (up to 1.4e-2). Both runs in kept test ranks
    (:func:`mnist_body`), which reset the rounding generators after each call, as a new process
    starts them."""
    job = ["--epochs", "1", "--comm-quant", "int8", "--checkpoint-every", "4", "--no-progress"]
    job += ["--data-dir", str(train_subset(tmp_path / "data", 0.25, 0.1))]
    run_ranks(mnist_body, 2, [*job, "--checkpoint-dir", str(tmp_path / "a"), "--save-model", str(tmp_path / "a.pt")])
    shutil.copytree(tmp_path / "a" / "step_00000004", tmp_path / "b" / "step_00000004")
    argv = [*job, "--checkpoint-dir", str(tmp_path / "b"), "--save-model", str(tmp_path / "b.pt")]
    (_, out, _), _ = run_ranks(mnist_body, 2, argv)
    assert "at epoch 1, sample 512 of its order" in out, out[-2000:]
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
