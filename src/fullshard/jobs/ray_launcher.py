"""Running a training job under Ray Train: ``fullshard train JOB --launcher ray``.

The driver (this process) starts a ``ray.train.torch.TorchTrainer`` on a local Ray instance or
the cluster at ``--ray-address``. Ray starts the workers and creates the process group (gloo
on CPU, NCCL with ``--use-gpu``); each worker runs the job's own ``worker(cfg)``, which adopts
that group (:func:`fullshard.jobs.launch.init_process_group`). Inside the workers the job's
session (``fullshard.jobs.train.session``) reports metrics with ``ray.train.report`` and saves
fullshard's sharded checkpoints as ``ray.train.Checkpoint``s: each worker saves its shards into
its own local directory and Ray merges them into the run's storage. ``--max-restarts`` becomes
``FailureConfig(max_failures=...)``: when a worker dies, Ray restarts the group and the job
resumes from the last reported checkpoint, resharded when the group's size changed
(``--num-workers MIN:MAX`` lets Ray choose the size within the range).

fullshard writes no scheduler or rendezvous of its own: this module only configures Ray's.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

RAY_MISSING = "--launcher ray needs Ray Train, which is not installed: pip install 'fullshard[ray]'"
PATH_FIELDS = ("metrics_file", "save_model", "checkpoint_dir", "data_dir")


def require_ray() -> None:
    """Check that Ray Train can be imported.

    Raises:
        ValueError: Ray is not installed, naming ``pip install 'fullshard[ray]'``.
    """
    try:
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise ValueError(RAY_MISSING) from None


def parse_num_workers(text: str) -> int | tuple[int, int]:
    """``"N"`` -> N workers; ``"MIN:MAX"`` -> an elastic range (Ray chooses within it).

    Raises:
        ValueError: not a positive count or a range MIN <= MAX, naming ``--num-workers``.
    """
    try:
        parts = [int(p) for p in str(text).split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1 and parts[0] >= 1:
        return parts[0]
    if len(parts) == 2 and 1 <= parts[0] <= parts[1]:
        return (parts[0], parts[1])
    raise ValueError(f"--num-workers {text!r}: give a count N >= 1 or a range MIN:MAX with 1 <= MIN <= MAX")


def run_job(name: str, worker: Callable[[Any], Any], cfg: Any) -> tuple[int, Any]:
    """Run ``worker(cfg)`` on every worker of a Ray Train TorchTrainer; (exit code, last metrics).

    The last metrics are rank 0's return value. The run is named ``fullshard-<job>`` and stored
    under ``--checkpoint-dir`` (Ray's default storage without one), so running the same command
    again resumes from its last checkpoint.
    A failure after the restarts ran out is printed to stderr, prefixed with ``name``, and gives
    exit code 1.
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = dataclasses.replace(
        cfg, **{f: os.path.abspath(getattr(cfg, f)) for f in PATH_FIELDS if getattr(cfg, f, None)}
    )
    workers = parse_num_workers(cfg.num_workers)
    if not ray.is_initialized():
        address = cfg.ray_address or os.environ.get("RAY_ADDRESS")  # Ray's own variable, as `ray job` sets it
        if address:
            ray.init(address=address)
        else:  # a local instance with a CPU for every worker, even on a smaller machine
            most = workers if isinstance(workers, int) else workers[1]
            ray.init(num_cpus=max(os.cpu_count() or 1, most), include_dashboard=False)
    run_name = f"fullshard-{name.split()[-1]}"
    box = ray.remote(num_cpus=0)(_ResultBox).remote()  # rank 0's return value comes back through it
    trainer = TorchTrainer(
        _train_func,
        train_loop_config={"worker": worker, "cfg": cfg, "box": box},
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        # Train V2's ScalingConfig takes a (min, max) range; mypy may see Train V1's stub
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=cfg.use_gpu),  # type: ignore[arg-type]
        run_config=RunConfig(
            name=run_name,
            storage_path=cfg.checkpoint_dir,
            failure_config=FailureConfig(max_failures=cfg.max_restarts),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
        ),
    )
    try:
        trainer.fit()
    except Exception as e:  # Ray's TrainingFailedError and its controller's errors
        print(f"{name}: the Ray Train run failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1, None
    return 0, ray.get(box.get.remote())  # type: ignore[attr-defined]


def _train_func(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs: the job's own worker function."""
    import torch

    if config["cfg"].use_gpu and torch.cuda.is_available():
        from ray.train.torch import get_device

        torch.cuda.set_device(get_device())
    result = config["worker"](config["cfg"])
    if result is not None:  # rank 0's
        import ray

        ray.get(config["box"].put.remote(result))


class _ResultBox:
    """A Ray actor holding the job's final record (rank 0's return value) for the driver."""

    def __init__(self) -> None:
        self.value: Any = None

    def put(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value
