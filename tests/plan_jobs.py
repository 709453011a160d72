"""The ``--plan auto`` check shared by the training jobs' tests (GPT, HF)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def check_plan_auto(job: list[str], tmp_path: Path, nothing_fits: bool = True) -> None:
    """``fullshard train JOB... --plan auto``: two steps under an ample budget print the plan and
    train as planned; a budget nothing fits fails on every rank with the smallest that would
    (``nothing_fits``: the jobs share that path, ``plan_options.planned_model``, so one job's
    test shows it)."""
    base = [str(Path(sys.executable).parent / "fullshard"), "train", *job, "--nproc", "2", "--steps", "2"]
    base += ["--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--log-interval", "1"]
    base += ["--no-progress", "--plan", "auto"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    metrics = tmp_path / "m.jsonl"
    run = [*base, "--memory-budget", "1GiB", "--metrics-file", str(metrics)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--plan auto: Plan for 1,024.0 MiB per rank: **" in r.stdout, r.stdout[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2] and records[-1]["val_loss"] > 0
    if not nothing_fits:
        return
    r = subprocess.run([*base, "--memory-budget", "1MiB"], capture_output=True, text=True, timeout=280, env=env)
    assert r.returncode != 0
    assert "--plan auto --memory-budget 1MiB: Nothing fits 1.0 MiB per rank" in r.stderr, r.stderr[-3000:]
