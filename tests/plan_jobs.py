"""The ``--plan auto`` check shared by the training jobs' tests (GPT, HF)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from dist import run_ranks


def job_body(rank: int, world: int, job: str, argv: list[str]) -> str:
    """Rank ``rank`` of ``fullshard train JOB --nproc WORLD ARGV`` in a kept test rank (no
    launcher; each rank of the command runs the same): what the rank printed."""
    module = importlib.import_module(f"fullshard.jobs.train.{job}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module._run(module.parse_args(["--nproc", str(world), *argv]), torch.device("cpu"))
    return out.getvalue()


def check_plan_auto(job: list[str], tmp_path: Path, nothing_fits: bool = True) -> None:
    """``fullshard train JOB... --plan auto``: two steps under an ample budget print the plan and
    train as planned (the job's ranks in kept test ranks); a budget nothing fits fails on every
    rank with the smallest that would, through the command (``nothing_fits``: the jobs share
    that path, ``plan_options.planned_model``, so one job's test shows it)."""
    args = ["--steps", "2", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--log-interval", "1"]
    args += ["--no-progress", "--plan", "auto"]
    metrics = tmp_path / "m.jsonl"
    out = run_ranks(job_body, 2, job[0], [*job[1:], *args, "--memory-budget", "1GiB", "--metrics-file", str(metrics)])
    assert "--plan auto: Plan for 1,024.0 MiB per rank: **" in out[0], out[0][-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2] and records[-1]["val_loss"] > 0
    if not nothing_fits:
        return
    base = [str(Path(sys.executable).parent / "fullshard"), "train", *job, "--nproc", "2", *args]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run([*base, "--memory-budget", "1MiB"], capture_output=True, text=True, timeout=280, env=env)
    assert r.returncode != 0
    assert "--plan auto --memory-budget 1MiB: Nothing fits 1.0 MiB per rank" in r.stderr, r.stderr[-3000:]
