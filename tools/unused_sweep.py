"""Parameters used on some ranks only, on a seed's drawn cases: a markdown table.

For each case of ``fullshard.jobs.planning.unused.draw(seed, n)`` (a model of Linear, Embedding
and GELU blocks, its units flagged or not, which parameters each rank's backward uses per step,
world size 2-4, HSDP, bf16 mixed precision, micro-batches, ``zero_grad`` or not, SGD or AdamW,
clipping), in fresh processes on this machine (gloo, :func:`fullshard.jobs.launch.launch`):
:func:`fullshard.jobs.planning.unused_check.check_rank` runs three steps on every rank against
an unsharded model (gradients averaged over ranks, ``.grad`` None or set alike on every rank,
hook counts, ``clip_grad_norm_``, the optimizer step). One row per case: its description,
world size, pass or the first failure, the largest relative gradient error, seconds. A case
still running after ``--timeout`` seconds (a hang) is killed and its row says so.

Usage (nothing is timed: the machine need not be idle)::

    PYTHONPATH=src python tools/unused_sweep.py SEED N [--start I] [--timeout 180]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from fullshard.jobs.planning.unused import case_at


def run_one(seed: int, index: int, collective_timeout: float) -> None:
    """In the child process: run case ``index`` on its ranks, print its result as one JSON line."""
    from fullshard.jobs import launch
    from fullshard.jobs.planning import unused_check

    c = case_at(seed, index)
    try:
        r = launch.launch(unused_check.worker, (c, collective_timeout), c.world)[0]
        out = {"failures": r.failures, "grad": r.grad_error, "norm": r.norm_error, "param": r.param_error}
    except launch.WorkerFailed as err:
        out = {"failures": [f"crashed: {str(err).splitlines()[0][:200]}"], "grad": float("nan")}
    print("RESULT " + json.dumps(out), flush=True)


def _child(seed: int, index: int, timeout: float) -> dict:
    """Run one case in a child process of its own (a new session, killed whole on timeout)."""
    cmd = [sys.executable, __file__, "--one", str(seed), str(index), "--timeout", str(timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"failures": [f"timed out after {timeout:.0f} s (a hang)"], "grad": float("nan")}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (err.strip().splitlines() or ["no output"])[-1]
    return {"failures": [f"no result (exit code {proc.returncode}): {tail[:200]}"], "grad": float("nan")}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("seed", type=int)
    p.add_argument("n", type=int)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a case may run before it counts as a hang")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child: N is the case's index
    a = p.parse_args(argv)
    if a.one:
        run_one(a.seed, a.n, a.timeout / 2)
        return
    print(f"Seed {a.seed}, cases {a.start}-{a.n - 1}, 3 steps each, timeout {a.timeout:.0f} s.\n")
    print("| case | world | result | max rel. grad error | s |")
    print("|---|---|---|---|---|")
    failed: list[str] = []
    for index in range(a.start, a.n):
        c = case_at(a.seed, index)
        start = time.perf_counter()
        r = _child(a.seed, index, a.timeout)
        verdict = "pass" if not r["failures"] else "FAIL: " + r["failures"][0].replace("|", "\\|")
        if r["failures"]:
            failed.append(f"#{index}: " + "; ".join(r["failures"][:3]))
        print(
            f"| {c.describe()} | {c.world} | {verdict} | {r['grad']:.1e} | {time.perf_counter() - start:.0f} |",
            flush=True,
        )
    print(f"\nPassed {a.n - a.start - len(failed)} of {a.n - a.start}.")
    for line in failed:
        print(f"- {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
