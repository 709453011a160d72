"""``fullshard plot METRICS.jsonl [...] -o FILE.png``: pictures of training runs from the jobs'
JSON-lines metrics files (``--metrics-file``), drawn with matplotlib.

Three panels: train and validation (MNIST: test) loss against the step (MNIST: the epoch), several runs
overlaid; throughput (tokens/s, or samples/s for MNIST); peak RSS per rank (MiB). Runs that log
a test accuracy (MNIST) get a fourth panel for it. A run that restarted logs some steps twice: the
last record of each step is drawn, as the run ended up.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_run(path: str | Path) -> list[dict[str, Any]]:
    """The records of one metrics file, the last one per step (or epoch), in step order.

    Raises:
        ValueError: the file holds no records, or a line is not JSON (naming the line).
    """
    by_x: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not a JSON line ({e.msg}): pass a --metrics-file of a job") from None
        by_x[int(rec.get("step", rec.get("epoch", len(by_x) + 1)))] = rec
    if not by_x:
        raise ValueError(f"{path} holds no records: pass a --metrics-file of a job that logged")
    return [by_x[x] for x in sorted(by_x)]


def _x(rec: dict[str, Any]) -> int:
    return int(rec.get("step", rec.get("epoch", 0)))


def draw(runs: dict[str, list[dict[str, Any]]], out: str | Path) -> Path:
    """Draw ``runs`` (label -> records) into the image ``out`` (format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy = any("test_accuracy" in r for recs in runs.values() for r in recs)
    fig, axes = plt.subplots(1, 4 if accuracy else 3, figsize=(20 if accuracy else 15, 4.2))
    loss, speed, mem = axes[:3]
    panels = [(loss, "loss (nats)"), (speed, "throughput"), (mem, "peak RSS per rank (MiB)")]
    if accuracy:
        panels.append((axes[3], "test accuracy"))
    for label, recs in runs.items():
        xs = [_x(r) for r in recs]
        for key, style in (("train_loss", "-"), ("val_loss", "--"), ("test_loss", ":")):
            ys = [r.get(key) for r in recs]
            if any(y is not None for y in ys):
                loss.plot(xs, ys, style, label=f"{label} {key.split('_')[0]}")
        rate = "tokens_per_second" if "tokens_per_second" in recs[0] else "samples_per_second"
        if rate in recs[0]:
            speed.plot(xs, [r.get(rate) for r in recs], label=label)
            speed.set_ylabel(rate.replace("_", " "))
        ranks = max((len(r.get("peak_rss_bytes", [])) for r in recs), default=0)
        for rank in range(ranks):
            ys = [r["peak_rss_bytes"][rank] / 2**20 if rank < len(r.get("peak_rss_bytes", [])) else None for r in recs]
            mem.plot(xs, ys, label=f"{label} rank {rank}")
        if accuracy:
            axes[3].plot(xs, [r.get("test_accuracy") for r in recs], "o-", label=label)
    unit = "step" if any("step" in r for recs in runs.values() for r in recs) else "epoch"
    for ax, title in panels:
        ax.set_xlabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str]) -> int:
    """``fullshard plot`` (returns the exit code; bad input: a message and 2)."""
    p = argparse.ArgumentParser(prog="fullshard plot", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", help="JSON-lines metrics files; LABEL=PATH names a run")
    p.add_argument("-o", "--output", required=True, help="the image to write (.png, .svg, .pdf)")
    ns = p.parse_args(list(argv))
    runs: dict[str, list[dict[str, Any]]] = {}
    for spec in ns.metrics:
        label, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).stem, "", spec)
        try:
            runs[label] = load_run(path)
        except (OSError, ValueError) as e:
            p.error(str(e))
    print(f"wrote {draw(runs, ns.output)}")
    return 0
