"""``fullshard bench steptime``: the predicted step time against the measured one.

For each configuration of :data:`fullshard.jobs.planning.validate.CONFIGS` (and SHARD_GRAD_OP /
NO_SHARD variants), ``world`` fresh processes calibrate this machine
(:func:`~fullshard.plan.steptime.calibrate`), predict the step, then build the job's own
model, wrapping and optimizer and time real steps (the median of ``steps`` after two warm-up
steps; rank 0's clock), three rounds of both in turn. Calibration, prediction and measurement
run in the same processes, so they see the same thread count and the same neighbours.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from fullshard.jobs import launch
from fullshard.jobs.planning.validate import CONFIGS, Config, _build, _parts, optimizer_of
from fullshard.plan.simulate import StepTime
from fullshard.plan.steptime import calibrate, predict_step

TIME_CONFIGS = [
    *CONFIGS,
    Config("gpt-tiny", 2, strategy="no_shard"),
    Config("gpt-tiny", 4, strategy="shard_grad_op"),
    Config("gpt-tiny", 2, batch=4),
    Config("mnist", 2, strategy="no_shard", batch=64),
]


def predict_config(c: Config, device: torch.device) -> StepTime:
    """Calibrate (collective) and predict ``c``'s step on this machine."""
    make, example, loss, is_unit = _parts(c)
    dtype = torch.bfloat16 if c.precision == "bf16" else None
    cal = calibrate(make, example, loss, is_unit, device, compute_dtype=dtype, optimizer=optimizer_of(c))
    names = [n for n in cal.blocks if n != "<root>"]
    return predict_step(
        cal,
        make,
        is_unit,
        no_shard=c.strategy == "no_shard",
        keep_gathered=names if c.strategy == "shard_grad_op" else (),
        checkpoint=names if c.ac else (),
        param_dtype=dtype,
    )


def measure_config(c: Config, device: torch.device, steps: int = 5) -> float:
    """Median seconds of ``steps`` real training steps of ``c`` after two warm-up steps."""
    _, example, loss_fn, _ = _parts(c)
    torch.manual_seed(0)
    model, opt = _build(c, device)
    times = []
    for i in range(steps + 2):
        batch = tuple(t.random_(0, 10) for t in example())
        start = time.perf_counter()
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(c: Config, rounds: int) -> tuple[StepTime, float]:
    """``rounds`` of (calibrate and predict, measure) in turn; the round with the median
    prediction and the median measured step. Alternating keeps a slow minute of the machine
    from landing only on the calibration or only on the measurement."""
    device = launch.init_process_group()
    try:
        preds, measured = [], []
        for _ in range(rounds):
            preds.append(predict_config(c, device))
            measured.append(measure_config(c, device))
        preds.sort(key=lambda p: p.seconds)
        return preds[len(preds) // 2], statistics.median(measured)
    finally:
        launch.destroy_process_group()


def report(configs: list[Config] | None = None, rounds: int = 3) -> list[str]:
    """Predict and measure every configuration (``rounds`` alternating rounds of each in the
    same processes, see ``_worker``); markdown lines of the table (ms, errors in %)."""
    rows = [
        "| configuration | predicted step (ms) | measured step (ms) | error | predicted compute / exposed comm / "
        "optimizer (ms) | all comm (ms) | serial error |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    chosen = configs or TIME_CONFIGS
    for c in chosen:
        pred, measured = launch.launch(_worker, (c, rounds), c.world, env=launch.BENCH_ENV)[0]
        err = (pred.seconds - measured) / measured
        worst = max(worst, abs(err))
        parts = " / ".join(f"{1e3 * x:.1f}" for x in (pred.compute, pred.exposed_comm, pred.optimizer))
        serial = pred.compute + pred.communication + pred.optimizer
        parts += f" | {1e3 * pred.communication:.1f} | {100 * (serial - measured) / measured:+.1f}%"
        rows.append(
            f"| {c.describe()} b{c.batch} | {1e3 * pred.seconds:.1f} | {1e3 * measured:.1f} | {100 * err:+.1f}% | "
            f"{parts} |"
        )
    rows.append(f"\nWorst error {100 * worst:.1f}% over {len(chosen)} configurations (goal: 20%).")
    return rows


def as_dict(t: StepTime) -> dict[str, Any]:
    return dataclasses.asdict(t)
