"""Ray Train's options and the start-up error when Ray is missing. The runs under Ray (a user's
own train_func under TorchTrainer resuming at another worker count, the job with a SIGKILLed
worker) are in test_elastic.py: one worker runs them one after the other on the run's Ray
cluster, where two files took turns on it and one worker waited for the other's test."""

from __future__ import annotations

import sys

import pytest


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
