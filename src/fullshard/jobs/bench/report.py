"""Where the benchmarks' output goes: the machine line, the generated sections of a markdown
file, and the comparison's chart.

Each benchmark owns one generated section of a markdown file (BENCHMARKS.md), between its BEGIN
and END marks; :func:`write_markdown` replaces that section and leaves the rest of the file,
other benchmarks' sections included, as it was.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any

import torch

COMPARE_BEGIN_MARK = "<!-- fullshard bench compare: begin (generated; edits are overwritten) -->"
COMPARE_END_MARK = "<!-- fullshard bench compare: end -->"
GPU_BEGIN_MARK = "<!-- fullshard bench gpu: begin -->"
GPU_END_MARK = "<!-- fullshard bench gpu: end -->"
_CHART_COLORS = ["tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:gray"]
_QUANTIZED_COLOR = "tab:purple"  # the quantized row's bar, wherever it stands


def machine_line(device: str) -> str:
    """Cores, memory, CPU (and GPU) model, torch version: where a table was measured.

    Args:
        device: the device the table was measured on ("cpu", "cuda", "cuda:0", ...).
    """
    cpu, mem = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB, "
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if device.startswith("cuda") else ", no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {mem}torch {torch.__version__}{gpu}"


def write_markdown(path: str, section: str, begin: str = COMPARE_BEGIN_MARK, end: str = COMPARE_END_MARK) -> None:
    """Replace the generated section of ``path`` (between ``begin`` and ``end``), or append it.

    A missing file is created with a title. The file is replaced atomically (written beside it,
    then renamed).
    """
    text = open(path).read() if os.path.exists(path) else "# fullshard benchmarks\n"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip() + "\n\n" + block
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_chart(path: str, all_results: dict[str, dict[str, dict[str, Any]]], names: Sequence[str]) -> None:
    """A PNG of step time and peak memory per implementation, one column per workload.

    Args:
        path: the PNG to write.
        all_results: per workload, per implementation, its figures: "step_s" (seconds),
            "peak_rss" (bytes) and, for "fullshard", "params".
        names: the implementations to draw, in order (at most five, and "fullshard quantized").

    Raises:
        SystemExit: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("fullshard bench: --chart needs matplotlib: pip install 'fullshard[bench]'") from e
    fig, axes = plt.subplots(2, len(all_results), figsize=(4.2 * len(all_results), 6.5), squeeze=False)
    for col, (workload, res) in enumerate(all_results.items()):
        for row, (key, label, scale) in enumerate(
            (("step_s", "step (s)", 1.0), ("peak_rss", "peak memory per rank (MiB)", 2**-20))
        ):
            ax = axes[row][col]
            palette = iter(_CHART_COLORS)
            colors = [_QUANTIZED_COLOR if n == "fullshard quantized" else next(palette) for n in names]
            ax.bar(range(len(names)), [res[n][key] * scale for n in names], color=colors)
            ax.set_xticks(range(len(names)), [n.replace(" ", "\n") for n in names], fontsize=8)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"{workload} ({res['fullshard']['params'] / 1e6:.1f}M params)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
