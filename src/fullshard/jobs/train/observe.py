"""What a training job reports besides its losses, and where: throughput, MFU, the step split into
compute and exposed communication, memory per rank, to the metrics file, TensorBoard
(``--tensorboard DIR``), a torch.profiler trace (``--profile-steps A:B``) and a tqdm bar.

MFU is the model's FLOPs per second over the device's peak. Model FLOPs are counted once, by
torch's FlopCounterMode over one forward and backward of the plain model on the meta device
(so activation recomputation is not counted: model FLOPs, not hardware FLOPs). The peak per rank
is ``--peak-tflops`` when given; on CUDA the datasheet's dense peak for the compute dtype of a
known GPU (H100, H200, A100); otherwise it is measured at start-up: every rank at once times
float32 (or the compute dtype on CUDA) 1024 x 1024 matrix products for 0.3 s, so on a CPU the
ranks share the cores as they do in training.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullshard import distributed, peak_rss_bytes

# Dense peak FLOP/s per GPU from the vendors' datasheets (SXM parts; no sparsity).
_DATASHEET = {
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add --tensorboard, --profile-steps, --profile-dir, --peak-tflops and --no-progress."""
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard scalars here (rank 0)")
    p.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="write a torch.profiler trace of steps A to B (1-based, inclusive) per rank to --profile-dir",
    )
    p.add_argument("--profile-dir", default="fullshard_profile", metavar="DIR", help="where the traces go")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak per rank for MFU (default: measured)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")


def parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B), 1-based inclusive steps; None -> None.

    Raises:
        ValueError: not two integers with 1 <= A <= B, naming ``--profile-steps``.
    """
    if text is None:
        return None
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: give A:B, two step numbers such as 5:7") from None
    if not 1 <= a <= b:
        raise ValueError(f"--profile-steps {text!r}: need 1 <= A <= B (steps count from 1)")
    return a, b


def validate(cfg: Any) -> None:
    """Check the observability options of a job config.

    Raises:
        ValueError: a bad ``--profile-steps`` or ``--peak-tflops``; ``--tensorboard`` without the
            tensorboard package (naming ``pip install 'fullshard[tensorboard]'``).
    """
    parse_profile_steps(cfg.profile_steps)
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        raise ValueError(f"--peak-tflops {cfg.peak_tflops}: give a positive number of TFLOP/s per rank")
    if cfg.tensorboard is not None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError(
                "--tensorboard needs the tensorboard package: pip install 'fullshard[tensorboard]'"
            ) from None


def model_flops(make_model: Callable[[], nn.Module], example: Callable[[], torch.Tensor]) -> int:
    """FLOPs of one forward and backward of ``make_model()`` on ``example()`` (both built on the
    meta device, nothing allocated); the output is summed to a scalar for backward.

    A model whose forward reads tensor values (``.item()``: some transformers models' mask code)
    cannot run on the meta device; for token inputs (an integer ``example`` of shape (batch,
    seq)) the count is then the usual estimate 6 x parameters x tokens.

    Raises:
        RuntimeError: the forward fails on the meta device and ``example`` is not token ids.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model, x = make_model(), example()
    try:
        with FlopCounterMode(display=False) as counter:
            model(x).float().sum().backward()
    except RuntimeError:
        if x.is_floating_point():
            raise
        return 6 * sum(p.numel() for p in model.parameters()) * x.numel()
    return int(counter.get_total_flops())


def peak_flops(device: torch.device, dtype: torch.dtype, tflops: float | None) -> tuple[float, str]:
    """(peak FLOP/s of one rank, how it was obtained). Collective when measured (a barrier)."""
    if tflops is not None:
        return tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in _DATASHEET.items():
            if key in name and dtype in table:
                return table[dtype], f"{key} datasheet, dense {str(dtype).removeprefix('torch.')}"
    else:
        dtype = torch.float32
    distributed.barrier(distributed.default_group())
    a = torch.randn(1024, 1024, device=device, dtype=dtype)
    b = torch.randn(1024, 1024, device=device, dtype=dtype)
    torch.mm(a, b)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3:
        torch.mm(a, b)
        n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rate = 2 * 1024**3 * n / (time.perf_counter() - start)
    return rate, f"measured: {str(dtype).removeprefix('torch.')} 1024^3 matmuls, all ranks at once"


class Observer:
    """Per-window metrics and their sinks for one rank of a job.

    Args:
        cfg: the job config (``tensorboard``, ``profile_steps``, ``profile_dir``, ``progress``).
        device: this rank's device.
        flops_per_sample: model FLOPs of one forward and backward of one sample (sequence or
            image), see :func:`model_flops`.
        peak: (peak FLOP/s per rank, how obtained), see :func:`peak_flops`.
        total_steps / first_step: for the progress bar (a tqdm bar of steps on rank 0 unless
            ``bar`` is False or ``cfg.progress`` is False; none when stderr is not a terminal).
    """

    def __init__(
        self,
        cfg: Any,
        device: torch.device,
        flops_per_sample: int,
        peak: tuple[float, str],
        total_steps: int,
        first_step: int = 0,
        bar: bool = True,
    ) -> None:
        group = distributed.default_group()
        self.rank, self.world = distributed.group_rank(group), distributed.group_size(group)
        self.device, self.flops_per_sample, (self.peak, self.peak_source) = device, flops_per_sample, peak
        self.profile = parse_profile_steps(cfg.profile_steps)
        self.profile_dir = Path(cfg.profile_dir)
        self._profiler: Any = None
        self.writer = _writer(cfg.tensorboard) if self.rank == 0 else None
        self.bar = _bar(total_steps, first_step) if bar and self.rank == 0 and cfg.progress else None
        self._window_end = (0.0, 0.0)  # (perf_counter, exposed seconds) at end_window
        self.start_window()  # sets self._window, the same at start_window

    def step_started(self, step: int) -> None:
        """Before optimizer step ``step`` (0-based): starts the profiler at step A."""
        if self.profile is not None and step + 1 == self.profile[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def step_finished(self, step: int) -> None:
        """After optimizer step ``step`` (0-based): stops the profiler after step B and writes
        ``<profile-dir>/rank<R>.pt.trace.json``; advances the bar."""
        if self._profiler is not None and step + 1 == self.profile[1]:  # type: ignore[index]
            self._profiler.__exit__(None, None, None)
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            path = self.profile_dir / f"rank{self.rank}.pt.trace.json"
            self._profiler.export_chrome_trace(str(path))
            self._profiler = None
            self.say(f"profiler trace of steps {self.profile[0]}-{self.profile[1]} written to {path}")  # type: ignore[index]
        if self.bar is not None:
            self.bar.update(1)

    def start_window(self) -> None:
        """A log window's steps begin now, after the previous window's logging and evaluation
        (collective: a barrier first, so every rank's window starts together; otherwise a rank
        that does not log would start early and count its wait for rank 0's logging as its
        window's communication, which can exceed rank 0's whole window)."""
        distributed.barrier(distributed.default_group())
        self._window = (time.perf_counter(), distributed.exposed_seconds())

    def end_window(self) -> None:
        """A log window's steps ended now: collectives after this (logging, evaluation) are not its."""
        self._window_end = (time.perf_counter(), distributed.exposed_seconds())

    def window(self, steps: int, samples: int, state_bytes: int) -> dict[str, Any]:
        """Metrics of the last log window (from :meth:`start_window` to :meth:`end_window`) of
        ``steps`` optimizer steps in which all ranks together trained ``samples`` samples
        (collective: gathers per-rank values).

        Returns: step_seconds (this rank's window over ``steps``; the record is rank 0's), per
        rank compute_seconds and comm_exposed_seconds (seconds per step: the rank's own window
        split into the time it was blocked in collectives and the rest, so the two add up to
        its own step time, which differs from rank 0's only by the ranks' skew at the window's
        end), samples_per_second (all ranks), mfu (fraction of the peak), peak_rss_bytes and
        sharded_state_bytes (per rank, bytes), and on CUDA cuda_max_allocated_bytes and
        cuda_max_reserved_bytes (per rank).
        """
        seconds = self._window_end[0] - self._window[0]
        exposed = (self._window_end[1] - self._window[1]) / max(steps, 1)
        mine: dict[str, Any] = {
            "compute_seconds": seconds / max(steps, 1) - exposed,
            "comm_exposed_seconds": exposed,
            "peak_rss_bytes": peak_rss_bytes(),
            "sharded_state_bytes": state_bytes,
        }
        if self.device.type == "cuda":
            mine["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            mine["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        rows = distributed.all_gather_object(mine, distributed.default_group())
        per_rank = {k: [r[k] for r in rows] for k in mine}
        step_seconds = seconds / max(steps, 1)
        rate = samples / seconds
        return {
            "samples_per_second": rate,
            "mfu": self.flops_per_sample * rate / (self.peak * self.world),
            "step_seconds": step_seconds,
            **per_rank,
        }

    def write(self, record: dict[str, Any], step: int) -> None:
        """Log ``record``'s numbers to TensorBoard at ``step`` (lists: one tag per rank)."""
        if self.writer is None:
            return
        for key, value in record.items():
            if isinstance(value, list):
                for r, v in enumerate(value):
                    self.writer.add_scalar(f"{key}/rank{r}", v, step)
            elif isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def say(self, line: str) -> None:
        """Print ``line`` on rank 0 (above the progress bar when there is one)."""
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        """Close the bar and the TensorBoard writer (and a profiler still running)."""
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _writer(directory: str | None) -> Any:
    if directory is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=directory)


def _bar(total: int, initial: int) -> Any:
    import sys

    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, CI).
    return tqdm(total=total, initial=initial, unit="step", file=sys.stderr, leave=False, disable=None)
