"""Predict a recorded CUDA estimate sweep's configurations again with this tree's estimator,
against the measurements the table recorded (``fullshard bench estimate --sweep --device cuda``,
``docs/estimate_cuda_sweep.md``), for when the estimator changed after the last GPU run.

    python tools/repredict_cuda_sweep.py docs/estimate_cuda_sweep.md SECTION [--skip FAMILY,...]

``SECTION``: which of the document's ``---``-separated parts holds the table (1: the first
table). Prints the table in the sweep's format with the predicted and error columns new and the
measured columns (MiB to 0.01, as recorded) and moments as they were, then the sweep's summary
(a prediction counts as below a measurement only by more than that rounding, 0.005 MiB).
Errors are against the recorded MiB, so each carries up to 0.005 MiB of rounding. ``--skip``:
families whose model code here differs from the run's (another transformers version), whose
rows are printed without a prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from fullshard.jobs.planning import sweep, sweep_bench, sweep_device
from fullshard.plan.peak import PeakEstimate

MIB = 2**20


def rows(section: str) -> list[tuple[int, int, bool, float, float, str]]:
    """(seed, index, offload, live MiB, allocator MiB, moment measured) of each measured row."""
    out = []
    for line in section.splitlines():
        m = re.match(r"\| (\d+)#(\d+) ", line)
        if not m:
            continue
        cells = [c.strip() for c in line.replace("\\|", "/").split("|")]
        if cells[4] == "-" or cells[6] == "-":
            continue
        moment = cells[8].split(" / ", 1)[1]
        out.append((int(m[1]), int(m[2]), cells[2] == "yes", float(cells[4]), float(cells[6]), moment))
    return out


def main(path: str, section: int, skip: set[str]) -> None:
    with open(path) as f:
        part = f.read().split("\n---\n")[section]
    measured = rows(part)
    seed = measured[0][0]
    configs = sweep.draw(seed, max(r[1] for r in measured) + 1)
    command = f"python tools/repredict_cuda_sweep.py {path} {section}" + (
        f" --skip {','.join(sorted(skip))}" if skip else ""
    )
    print(
        f"Seed {seed}: the configurations of section {section} of {path} predicted again at this tree "
        f"(`{command}`), against the MiB measured there.\n"
    )
    print("\n".join(sweep_device.DEVICE_HEADER))
    done = []
    for _, index, offload, live, alloc, moment in measured:
        c = dataclasses.replace(configs[index], world=1)
        estimate: PeakEstimate | None = None
        if c.family in skip:
            failure = "not predicted again: its model code here differs from the run's"
        else:
            estimate, failure = sweep_bench.predicted(c, "nccl", offload)
        row = sweep_bench.Row(c, estimate, round(live * MIB), moment, failure)
        done.append(sweep_device.DeviceRow(row, offload, round(alloc * MIB)))
        print(sweep_device.format_device_row(done[-1]), flush=True)
    print()
    print("\n".join(sweep_device.device_summary(done, tolerance=MIB // 200)))
    worst = min((d.allocator_error for d in done if not math.isnan(d.allocator_error)), default=math.nan)
    print(f"\nLowest error against the allocator's peak: {100 * worst:+.2f}%.")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("section", type=int)
    p.add_argument("--skip", default="", help="families, comma-separated, not to predict again")
    args = p.parse_args()
    main(args.path, args.section, {f for f in args.skip.split(",") if f})
