"""Ray Train: a user's own train_func with fullshard under TorchTrainer (resuming at another
worker count), and the start-up error when Ray is missing. The job under Ray with a SIGKILLed
worker is in test_elastic.py (it shares that file's uninterrupted reference run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ray_train_fsdp.py"


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


def test_launcher_ray_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from fullshard.jobs.train import gpt, mnist

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    monkeypatch.setitem(sys.modules, "ray.train", None)
    monkeypatch.setitem(sys.modules, "ray.train.torch", None)
    for parse in (gpt.parse_args, mnist.parse_args):
        with pytest.raises(SystemExit) as e:
            parse(["--launcher", "ray", "--num-workers", "2"])
        assert e.value.code == 2
        assert "pip install 'fullshard[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-workers", "2"], "need --launcher ray"),
        (["--launcher", "ray", "--num-workers", "3:2"], "--num-workers '3:2'"),
        (["--launcher", "ray", "--num-workers", "zero"], "MIN:MAX"),
    ],
)
def test_launcher_options_are_checked(argv: list[str], message: str, capsys) -> None:
    from fullshard.jobs.train import gpt

    with pytest.raises(SystemExit):
        gpt.parse_args(argv)
    assert message in capsys.readouterr().err


def test_num_workers_range() -> None:
    from fullshard.jobs.ray_launcher import parse_num_workers

    assert parse_num_workers("4") == 4
    assert parse_num_workers("1:4") == (1, 4)
