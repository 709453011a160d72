"""Elastic fault tolerance: SIGKILL a worker mid-run; the job restarts itself, resumes from the
last complete checkpoint and ends with exactly the parameters of an uninterrupted run. Under Ray
Train too, and a user's own train_func under TorchTrainer resuming at another worker count (the
two Ray tests are in this file so that one worker runs them in turn on the shared cluster)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mnist_idx import train_subset

BIN = Path(sys.executable).parent
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ray_train_fsdp.py"
STEPS = 16


def _args(tmp: Path, name: str) -> list[str]:
    return [
        str(BIN / "fullshard"),
        "train",
        "gpt",
        "--nproc",
        "2",
        "--steps",
        str(STEPS),
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--log-interval",
        "1",
        "--eval-batches",
        "1",
        "--checkpoint-every",
        "4",
        "--checkpoint-dir",
        str(tmp / f"{name}-ckpt"),
        "--metrics-file",
        str(tmp / f"{name}.jsonl"),
        "--save-model",
        str(tmp / f"{name}.pt"),
        "--max-restarts",
        "2",
    ]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", **extra)


def _workers(launcher: int) -> list[int]:
    """PIDs of the launcher's worker processes, in start order: children of its forkserver
    (how ``fullshard.jobs.launch`` starts them), or its spawned children."""
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
    servers = {pid for pid, ppid in parents.items() if ppid == launcher and b"forkserver" in commands[pid]}
    found = [pid for pid, ppid in parents.items() if ppid in servers]
    found += [pid for pid, ppid in parents.items() if ppid == launcher and b"spawn_main" in commands[pid]]
    return sorted(found)


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _final(path: Path) -> dict:
    return torch.load(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("reference")
    r = subprocess.run(_args(tmp, "ref"), capture_output=True, text=True, timeout=280, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return _final(tmp / "ref.pt")


SITECUSTOMIZE = """
import os
if os.environ.get("FULLSHARD_TEST_KILL_IN_SAVE"):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    _real = FileSystemWriter.write_data
    _step = int(os.environ["FULLSHARD_TEST_KILL_IN_SAVE"])

    def write_data(self, plan, planner):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and os.environ.get("RANK") == "1" and str(self.path).endswith(f"step_{_step:08d}.tmp"):
            (self.path / "__1_0.distcp").write_bytes(b"half a shard")
            os.kill(os.getpid(), 9)  # dies in the middle of writing its shard
        return _real(self, plan, planner)

    FileSystemWriter.write_data = write_data
"""


@pytest.mark.timeout(400)
def test_sigkill_in_the_middle_of_a_save_then_at_a_random_step_resumes_exactly(tmp_path: Path, reference: dict) -> None:
    """One job, two failures: rank 1 dies half-way through writing step 8's checkpoint (the
    restart resumes from step 4, the torn step-8 folder never counts), then a random worker is
    SIGKILLed at a random step after the restarted run's own step-8 checkpoint (the second
    restart resumes from 8 or 12). The job ends bitwise equal to the uninterrupted run."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = _env(FULLSHARD_TEST_KILL_IN_SAVE="8", PYTHONPATH=str(inject))
    proc = subprocess.Popen(_args(tmp_path, "run"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rng = random.Random(1)
    kill_at = rng.randint(9, STEPS - 3)  # the second attempt's step-8 save is complete by step 9's record
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "run-ckpt" / "step_00000008").is_dir():  # only the second attempt gets there
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the restarted run did not save step 8"
            time.sleep(0.05)
        while _last_step(tmp_path / "run.jsonl") < kill_at:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach the kill step"
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(rng.choice(workers), signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert out.count("resumed from") == 2, out[-3000:]
    assert "step_00000004 at step 4" in out, out[-3000:]  # the torn step-8 save was passed over
    assert any(f"step_{s:08d} at step {s}" in out for s in (8, 12)), out[-3000:]
    final = _final(tmp_path / "run.pt")
    assert list(final) == list(reference)
    for k, v in reference.items():
        assert torch.equal(final[k], v), k  # bitwise, not approximately
    left = sorted(p.name for p in (tmp_path / "run-ckpt").iterdir())
    assert left == ["step_00000008", "step_00000012", "step_00000016"], left  # keep=3, no .tmp left


def _mnist_args(tmp: Path, name: str) -> list[str]:
    """Two epochs of 16 steps per rank on ``tmp/data`` (half the shipped training images and a
    fifth of its test images, see :func:`mnist_idx.train_subset`), a checkpoint every 10 steps."""
    return [
        str(BIN / "fullshard"),
        "train",
        "mnist",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--data-dir",
        str(tmp / "data"),
        "--checkpoint-every",
        "10",
        "--checkpoint-dir",
        str(tmp / f"{name}-ckpt"),
        "--save-model",
        str(tmp / f"{name}.pt"),
        "--max-restarts",
        "1",
        "--no-progress",
    ]


@pytest.mark.timeout(400)
def test_mnist_sigkill_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    """Dropout RNG, the position inside the epoch, Adadelta and StepLR all come back."""
    train_subset(tmp_path / "data", 0.5, 0.2)
    r = subprocess.run(_mnist_args(tmp_path, "ref"), capture_output=True, text=True, timeout=280, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    proc = subprocess.Popen(
        _mnist_args(tmp_path, "run"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    deadline = time.monotonic() + 200
    while not (tmp_path / "run-ckpt" / "step_00000020").is_dir():  # step 20: inside epoch 2
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach step 20"
        time.sleep(0.02)
    os.kill(_workers(proc.pid)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in out and "at epoch 2" in out, out[-2000:]
    want, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _started(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot."""
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])


def _ray_train_workers(since: int) -> list[int]:
    """PIDs of the Ray Train worker processes started after process ``since`` (the driver): the
    shared cluster's raylet starts them, and one test uses the cluster at a time."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"RayTrainWorker" in (entry / "cmdline").read_bytes():
                if _started(int(entry.name)) >= _started(since):
                    found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(found)


@pytest.mark.timeout(400)
def test_ray_train_worker_sigkill_resumes_exactly(tmp_path: Path, reference: dict, ray_cluster: dict) -> None:
    """Under Ray Train: FailureConfig restarts the worker group, which resumes from the last
    checkpoint it reported (Ray merged the workers' shard directories) and ends bitwise equal."""
    args = [*_args(tmp_path, "run"), "--launcher", "ray", "--num-workers", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_cluster)
    try:
        deadline = time.monotonic() + 200
        while _last_step(tmp_path / "run.jsonl") < 7:  # past the checkpoint of step 4
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 7"
            time.sleep(0.05)
        workers = _ray_train_workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and "fullshard-gpt/step_00000" in out, out[-3000:]
    final = _final(tmp_path / "run.pt")
    for k, v in reference.items():
        assert torch.equal(final[k], v), k
    saved = tmp_path / "run-ckpt" / "fullshard-gpt" / f"step_{STEPS:08d}"
    assert sorted(p.name for p in saved.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "extra_rank0.pt",
        "extra_rank1.pt",
        "manifest.json",
    ]


def _example(storage: Path, workers: int, epochs: int, env: dict[str, str]) -> tuple[dict, str]:
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "--num-workers", str(workers), "--epochs", str(epochs)]
        + ["--storage-path", str(storage)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    last = [line for line in r.stdout.splitlines() if line.startswith('{"losses"')]
    assert last, r.stdout[-3000:]
    return json.loads(last[-1]), r.stdout + r.stderr


@pytest.mark.timeout(400)
def test_user_train_func_under_torch_trainer_resumes_at_another_worker_count(tmp_path: Path, ray_cluster: dict) -> None:
    first, _ = _example(tmp_path, workers=2, epochs=2, env=ray_cluster)
    assert len(first["losses"]) == 2
    ckpt = Path(first["checkpoint"])  # merged by Ray from both workers' directories
    names = sorted(p.name for p in ckpt.iterdir())
    want = [".metadata", "__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt", "manifest.json"]
    assert names == want, names

    # The same run started again on one worker: Ray hands it the last checkpoint, which reshards.
    second, output = _example(tmp_path, workers=1, epochs=3, env=ray_cluster)
    assert "resumed at epoch 2 on 1 workers" in output, output[-3000:]
    assert second["losses"][:2] == first["losses"]
    assert len(second["losses"]) == 3 and second["losses"][-1] < first["losses"][-1] < first["losses"][0]

    # The final checkpoint is a complete one: it converts to a full state dict of the plain model.
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import ray_train_fsdp
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    from fullshard.state import checkpoint

    out = checkpoint.consolidate(second["checkpoint"], tmp_path / "full.pt")
    model = ray_train_fsdp.make_model()
    model.load_state_dict(torch.load(out), strict=True)
