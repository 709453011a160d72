"""``fullshard train mnist``: the PyTorch FSDP tutorial's MNIST model, sharded by fullshard.

Recipe: parse the config, start the workers, and in each: build the data, build and wrap the
model, train and test every epoch, report, save, close.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Subset

from fullshard import checkpoint as checkpoints
from fullshard import distributed, memory_report, model_state_bytes
from fullshard.jobs import launch
from fullshard.jobs.data import mnist as mnist_data
from fullshard.jobs.data.sampler import ResumableSampler
from fullshard.jobs.models.net import Net
from fullshard.jobs.train import fsdp_options, launcher_options, observe, output_paths, plan_options, resume_options
from fullshard.jobs.train.report import MetricsFile, mib
from fullshard.jobs.train.session import Session, open_session
from fullshard.wrap import size_based_auto_wrap_policy


@dataclasses.dataclass
class MnistConfig:
    """Options of the MNIST job (see ``fullshard train mnist --help``)."""

    nproc: int = 2
    epochs: int = 10
    batch_size: int = 64
    test_batch_size: int = 1000
    lr: float = 1.0
    gamma: float = 0.7
    seed: int = 1
    sharding_strategy: str = "full_shard"
    min_num_params: int = 20000
    data_dir: str | None = None
    save_model: str | None = None
    metrics_file: str | None = None
    progress: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    max_restarts: int = 0
    mixed_precision: str = "none"
    cpu_offload: bool = False
    backward_prefetch: str = "pre"
    forward_prefetch: bool = False
    comm_quant: str = "none"
    api: str = "fsdp1"
    launcher: str = "torch"
    num_workers: str | None = None
    use_gpu: bool = False
    ray_address: str | None = None
    collective_timeout: float | None = None
    tensorboard: str | None = None
    profile_steps: str | None = None
    profile_dir: str = "fullshard_profile"
    peak_tflops: float | None = None
    plan: str = "none"
    memory_budget: str | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {self.nproc}")
        for name in ("epochs", "batch_size", "test_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):  # NaN fails every comparison
            raise ValueError(f"--lr {self.lr}: give a positive, finite learning rate")
        if not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise ValueError(f"--gamma {self.gamma}: give the lr's positive factor per epoch (0.7: 30% less each)")
        if self.min_num_params < 0:
            raise ValueError(f"--min-num-params {self.min_num_params}: give a parameter count, 0 or more")
        fsdp_options.validate(self)
        plan_options.validate(self)
        resume_options.validate(self)
        launcher_options.validate(self)
        observe.validate(self)
        output_paths.validate(self)
        if self.data_dir is not None:
            if not os.path.isdir(self.data_dir):
                raise ValueError(f"--data-dir {self.data_dir} is not a directory")
            try:
                mnist_data.find_idx_files(self.data_dir)
            except FileNotFoundError as e:
                raise ValueError(str(e)) from None


def parse_args(argv: Sequence[str]) -> MnistConfig:
    """Parse command-line options into a validated MnistConfig (exits with a message on error)."""
    d = MnistConfig()
    p = argparse.ArgumentParser(prog="fullshard train mnist", description=__doc__)
    p.add_argument("--nproc", type=int, default=launch.default_nproc(), help="worker processes (default: GPUs, else 2)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per-rank training batch")
    p.add_argument("--test-batch-size", type=int, default=d.test_batch_size)
    p.add_argument("--lr", type=float, default=d.lr, help="Adadelta learning rate")
    p.add_argument("--gamma", type=float, default=d.gamma, help="StepLR decay per epoch")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--min-num-params", type=int, default=d.min_num_params, help="size-based auto-wrap threshold")
    p.add_argument("--data-dir", default=None, help="folder with the 4 MNIST IDX files (default: bundled subset)")
    p.add_argument("--save-model", default=None, metavar="PATH", help="write the full state dict here")
    p.add_argument("--metrics-file", default=None, metavar="PATH", help="JSON lines, one per epoch")
    fsdp_options.add_arguments(p)
    plan_options.add_arguments(p)
    resume_options.add_arguments(p)
    launcher_options.add_arguments(p)
    observe.add_arguments(p)
    ns = p.parse_args(list(argv))
    try:
        return MnistConfig(**vars(ns))
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")  # one line: the options parsed, their values did not fit
        raise  # unreachable: p.exit exits


def _loaders(cfg: MnistConfig, rank: int, world: int) -> tuple[DataLoader, DataLoader, ResumableSampler]:
    train_set, test_set = mnist_data.load(cfg.data_dir)
    sampler = ResumableSampler(train_set, num_replicas=world, rank=rank, seed=cfg.seed)
    train = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)
    # Test on a strided, unpadded share of the test set so every image counts exactly once.
    test = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=cfg.test_batch_size)
    return train, test, sampler


@dataclasses.dataclass
class _Position:
    """Where training stands, the same on every rank: what a checkpoint must restore for an
    exact resume. It is global, so it holds at any world size: rank 0's checkpoint extra carries
    it and every rank loads it from there; each rank's extra carries its own RNG state."""

    epoch: int = 1
    sample: int = 0  # samples of ``epoch``'s order trained, all ranks together (ResumableSampler)
    step: int = 0  # optimizer steps in all
    # this epoch's loss sum and samples, all ranks together, trained before this run's part of it
    stats: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    norm: float = 0.0  # the global grad norm of the epoch's last step, once it is trained
    rng: Any = None  # this rank's torch RNG state after ``step`` (dropout)


def _train_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    bar: Any,
    pos: _Position,
    after_step: Any,
    obs: observe.Observer,
) -> torch.Tensor:
    """Train the rest of an epoch (the loader's sampler starts at ``pos.sample``); this rank's
    (loss sum, samples) of this part and the epoch's last grad norm, float64."""
    model.train()
    obs.start_window()
    world = loader.sampler.num_replicas  # type: ignore[attr-defined]
    stats = torch.tensor([0.0, 0.0, pos.norm], dtype=torch.float64, device=device)  # loss sum, samples, norm
    batches = iter(loader)  # creating it draws from the RNG, so a resume restores the RNG after
    if pos.rng is not None:
        torch.set_rng_state(pos.rng)
        pos.rng = None
    for i, (data, target) in enumerate(batches):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        obs.step_started(pos.step)
        loss = F.nll_loss(model(data).float(), target, reduction="sum")
        loss.backward()
        if i == len(loader) - 1:  # the epoch's last step: its global norm goes in the record
            stats[2] = fsdp_options.clip_grad_norm_(model, math.inf).item()
        optimizer.step()
        stats[0] += loss.item()
        stats[1] += len(data)
        # Every rank's batch has this length (the sampler deals each the same count).
        pos.sample, pos.step, pos.norm = pos.sample + world * len(data), pos.step + 1, stats[2].item()
        after_step(pos, stats)
        obs.step_finished(pos.step - 1)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item() / len(data):.4f}")
    obs.end_window()
    return stats


def _test(model: nn.Module, loader: DataLoader, device: torch.device) -> torch.Tensor:
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data).float()
            stats[0] += F.nll_loss(output, target, reduction="sum").item()
            stats[1] += (output.argmax(dim=1) == target).sum().item()
            stats[2] += len(data)
    return stats


def build_model(cfg: MnistConfig, device: torch.device) -> nn.Module:
    """The Net on ``device``, sharded by the size-based auto-wrap policy (``--min-num-params``),
    or under ``--plan auto`` as planned for the per-rank ``--batch-size`` (images (B, 1, 28, 28)
    float32, summed NLL loss, Adadelta; :func:`plan_options.planned_model`)."""
    if cfg.plan == "auto":

        def example() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros(cfg.batch_size, 1, 28, 28), torch.zeros(cfg.batch_size, dtype=torch.long)

        def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return F.nll_loss(model(batch[0]).float(), batch[1], reduction="sum")

        def is_unit(m: nn.Module) -> bool:  # what the size-based policy wraps: leaves this large
            return not list(m.children()) and sum(p.numel() for p in m.parameters()) >= cfg.min_num_params

        return plan_options.planned_model(cfg, device, Net, is_unit, parts=(example, loss_fn), optimizer="adadelta")
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.min_num_params)
    return fsdp_options.shard_model(Net().to(device), cfg, policy)


def worker(cfg: MnistConfig) -> dict[str, Any] | None:
    """One rank of the job. Returns the last epoch's metrics on rank 0, None elsewhere."""
    device = launch.init_process_group()
    launcher_options.watchdog_on()
    try:
        return _run(cfg, device)
    finally:
        launch.destroy_process_group()


def _run(cfg: MnistConfig, device: torch.device) -> dict[str, Any] | None:
    group = distributed.default_group()
    rank, world = distributed.group_rank(group), distributed.group_size(group)
    torch.manual_seed(cfg.seed)
    train_loader, test_loader, sampler = _loaders(cfg, rank, world)
    model = build_model(cfg, device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=cfg.lr)
    if rank == 0:
        print(f"{model}\n{memory_report(model, optimizer).summary()}", flush=True)
    scheduler = StepLR(optimizer, step_size=1, gamma=cfg.gamma)
    session = open_session(cfg)
    pos = _resume(session, model, optimizer, scheduler, cfg.batch_size, cfg.epochs)
    metrics = MetricsFile(cfg.metrics_file, rank == 0, append=pos.step > 0)
    bar = _progress(cfg, rank, len(train_loader))
    obs = _observer(cfg, device, cfg.epochs * len(train_loader))
    record: dict[str, Any] | None = None

    def after_step(p: _Position, trained: torch.Tensor) -> None:
        if cfg.checkpoint_every and p.step % cfg.checkpoint_every == 0:
            session.save(p.step, model, optimizer, _checkpoint_extra(p, trained, scheduler))

    for epoch in range(pos.epoch, cfg.epochs + 1):
        sampler.set_epoch(epoch)
        sampler.set_start(pos.sample)
        start = time.perf_counter()
        if bar is not None:
            bar.reset()
            bar.set_description(f"epoch {epoch}/{cfg.epochs}")
        steps, before = len(train_loader), torch.tensor(pos.stats, dtype=torch.float64, device=device)
        trained = _train_epoch(model, train_loader, optimizer, device, bar, pos, after_step, obs)
        pos.epoch, pos.sample, pos.stats, pos.norm = epoch + 1, 0, [0.0, 0.0], 0.0
        test_stats = _test(model, test_loader, device)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        seconds = time.perf_counter() - start
        norm = trained[2].item()  # the same on every rank: read before the sum
        distributed.all_reduce(trained, group)
        distributed.all_reduce(test_stats, group)
        train_stats = before + trained[:2]  # the epoch's, with the part trained before a resume
        record = {
            "epoch": epoch,
            "train_loss": train_stats[0].item() / train_stats[1].item(),
            "train_samples": round(train_stats[1].item()),
            "test_loss": test_stats[0].item() / test_stats[2].item(),
            "test_accuracy": test_stats[1].item() / test_stats[2].item(),
            "grad_norm": norm,
            "lr": lr,
            "epoch_seconds": seconds,
        }
        # Throughput of what this run trained: samples restored from a checkpoint took no time here.
        samples = round(trained[1].item())
        record.update(obs.window(steps, samples, model_state_bytes(model, optimizer)["total"]))
        _print_epoch(record, cfg.epochs, bar if rank == 0 else False)
        metrics.write(record)
        obs.write(record, epoch)
        session.report(record)
    if bar is not None:
        bar.close()
    obs.close()
    fsdp_options.save_full_model(model, cfg.save_model)
    return record if rank == 0 else None


def _observer(cfg: MnistConfig, device: torch.device, total_steps: int) -> observe.Observer:
    """Metrics sinks of the job, with the Net's FLOPs per image and the peak per rank."""
    flops = observe.model_flops(Net, lambda: torch.zeros(1, 1, 28, 28))
    peak = observe.peak_flops(device, fsdp_options.PRECISIONS[cfg.mixed_precision] or torch.float32, cfg.peak_tflops)
    return observe.Observer(cfg, device, flops, peak, total_steps, bar=False)  # the job has its own bar


def _checkpoint_extra(pos: _Position, trained: torch.Tensor, scheduler: StepLR) -> dict[str, Any]:
    """This rank's extra state for a checkpoint after ``pos.step`` (collective: it sums the
    ranks' statistics): its RNG state, and on rank 0 the position with the whole epoch's
    statistics so far and the scheduler, which every rank loads from rank 0's file."""
    group = distributed.default_group()
    done = trained[:2].clone()  # this rank's loss sum and samples of this run's part of the epoch
    distributed.all_reduce(done, group)
    extra: dict[str, Any] = {"rng": torch.get_rng_state(), "rounding_rng": checkpoints.rounding_state()}
    if distributed.group_rank(group) == 0:
        saved = dataclasses.replace(pos, stats=[a + b for a, b in zip(pos.stats, done.tolist())], rng=None)
        position = {k: v for k, v in dataclasses.asdict(saved).items() if k != "rng"}
        extra["position"] = {**position, "world": distributed.group_size(group), "scheduler": scheduler.state_dict()}
    return extra


def _resume(
    session: Session,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: StepLR,
    batch_size: int,
    epochs: int,
) -> _Position:
    """The session's newest checkpoint loaded, if any; where to continue (collective).

    The position comes from rank 0's extra, broadcast, so ranks that did not exist when the
    checkpoint was saved continue from the same sample as the others; each rank restores its own
    RNG state if the checkpoint has one for it (a new rank keeps its own).

    Raises:
        ValueError: the checkpoint is in an epoch past ``epochs`` (``--epochs``): nothing to train.
    """
    resumed = session.resume(model, optimizer)
    if resumed is None:
        return _Position()
    group = distributed.default_group()
    rank = distributed.group_rank(group)
    own = ("rng", "rounding_rng")  # each rank's own
    shared = {k: v for k, v in resumed.extra.items() if k not in own} if rank == 0 else None
    shared = distributed.broadcast_object(shared, 0, group)
    saved = shared["position"] if "position" in shared else _legacy_position(shared, resumed.extra, batch_size)
    scheduler.load_state_dict(saved["scheduler"])
    checkpoints.set_rounding_state(resumed.extra.get("rounding_rng", {}))  # --comm-quant's stochastic rounding
    fields = {f.name for f in dataclasses.fields(_Position)}
    pos = _Position(**{k: v for k, v in saved.items() if k in fields}, rng=resumed.extra.get("rng"))
    if pos.epoch > epochs:
        raise ValueError(
            f"--epochs {epochs} is below the epoch of the checkpoint resumed from, {pos.epoch} ({resumed.path}): "
            f"pass --epochs {pos.epoch} or more to go on from it, or another --checkpoint-dir to start afresh"
        )
    if rank == 0:
        at = f"at epoch {pos.epoch}, sample {pos.sample} of its order"
        print(f"resumed from {resumed.path} {at} (saved at {saved['world'] or '?'} ranks)", flush=True)
    return pos


def _legacy_position(shared: dict[str, Any], mine: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The position of a checkpoint saved before positions were global: every rank's extra held
    its own ``batch`` count and ``stats``. Exact only at the world size and batch size that saved
    it, which it does not record (collective: sums the ranks' statistics)."""
    group = distributed.default_group()
    stats = torch.tensor(mine.get("stats", [0.0, 0.0]), dtype=torch.float64)
    distributed.all_reduce(stats, group)
    sample = shared["batch"] * batch_size * distributed.group_size(group)
    return {**shared, "sample": sample, "stats": stats.tolist(), "world": None}


def _progress(cfg: MnistConfig, rank: int, total: int) -> Any:
    if rank != 0 or not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="batch", file=sys.stderr, leave=False, dynamic_ncols=True, disable=None)


def _print_epoch(r: dict[str, Any], epochs: int, bar: Any) -> None:
    """Print the epoch's line on rank 0 (``bar`` False elsewhere), above the bar if there is one."""
    if bar is False:
        return
    line = (
        f"epoch {r['epoch']}/{epochs}  train loss {r['train_loss']:.4f}  test loss {r['test_loss']:.4f}  "
        f"accuracy {r['test_accuracy']:.4f}  {r['samples_per_second']:,.0f} samples/s  MFU {100 * r['mfu']:.1f}%  "
        f"{r['epoch_seconds']:.1f} s  "
        f"peak RSS per rank [{', '.join(mib(b) for b in r['peak_rss_bytes'])}]  "
        f"sharded state per rank [{', '.join(mib(b) for b in r['sharded_state_bytes'])}]"
    )
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)


def main(argv: Sequence[str]) -> int:
    """Entry point: run under an existing launcher (torchrun) or start ``--nproc`` workers."""
    cfg = parse_args(argv)
    code, final = launch.run_job("fullshard train mnist", worker, cfg, cfg.nproc, max_restarts=cfg.max_restarts)
    if final is not None:
        print(f"final test accuracy {final['test_accuracy']:.4f} after {final['epoch']} epochs", flush=True)
    return code
