"""`fullshard plot`: metrics files of runs drawn with matplotlib (in-process, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fullshard.cli import main


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_plot_draws_overlaid_runs_and_keeps_the_last_record_of_a_step(tmp_path: Path) -> None:
    from fullshard.jobs.plot import load_run

    rec = {"train_loss": 3.0, "val_loss": 2.9, "tokens_per_second": 5e3, "peak_rss_bytes": [2**28, 2**28]}
    # A restart trained steps 3-4 again: the later records stand.
    a = _write(tmp_path / "a.jsonl", [{**rec, "step": s, "train_loss": 4.0 - s / 10} for s in (1, 2, 3, 4, 3, 4, 5)])
    b = _write(tmp_path / "b.jsonl", [{**rec, "step": s, "peak_rss_bytes": [2**28]} for s in (1, 2, 3)])
    run = load_run(a)
    assert [r["step"] for r in run] == [1, 2, 3, 4, 5]
    out = tmp_path / "runs.png"
    assert main(["plot", f"elastic={a}", str(b), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_names_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(SystemExit):
        main(["plot", str(bad), "-o", str(tmp_path / "x.png")])
    assert f"{bad}:2 is not a JSON line" in capsys.readouterr().err
