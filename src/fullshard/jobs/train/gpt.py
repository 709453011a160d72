"""``fullshard train gpt``: a byte-level decoder-only transformer on real text, sharded by fullshard.

Recipe: parse the config, start the workers, and in each: load the corpus, build the model on
the meta device and let FSDP materialize each rank's shards (one unit per transformer block),
train with AdamW under warmup and cosine decay, report every log interval, save, close.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullshard import apply_activation_checkpointing, distributed, memory_report, model_state_bytes, set_step
from fullshard import checkpoint as checkpoints
from fullshard.jobs import launch
from fullshard.jobs.data import text as text_data
from fullshard.jobs.data.text import ByteCorpus
from fullshard.jobs.models.gpt import GPT, PRESETS, Block, init_module
from fullshard.jobs.train import (
    fsdp_options,
    global_batch,
    launcher_options,
    observe,
    output_paths,
    plan_options,
    resume_options,
)
from fullshard.jobs.train.report import MetricsFile, mib
from fullshard.jobs.train.session import Session, open_session
from fullshard.wrap import transformer_auto_wrap_policy, unit_count


@dataclasses.dataclass
class GPTJobConfig:
    """Options of the GPT job (see ``fullshard train gpt --help``)."""

    preset: str = "tiny"
    nproc: int = 2
    steps: int = 300
    seq_len: int = 128
    batch_size: int = 16
    global_batch_size: int | None = None
    lr: float = 3e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1
    data: str | None = None
    log_interval: int = 50
    eval_batches: int = 8
    activation_checkpointing: bool = False
    sharding_strategy: str = "full_shard"
    mixed_precision: str = "none"
    cpu_offload: bool = False
    backward_prefetch: str = "pre"
    forward_prefetch: bool = False
    comm_quant: str = "none"
    api: str = "fsdp1"
    plan: str = "none"
    memory_budget: str | None = None
    metrics_file: str | None = None
    save_model: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    max_restarts: int = 0
    launcher: str = "torch"
    num_workers: str | None = None
    use_gpu: bool = False
    ray_address: str | None = None
    collective_timeout: float | None = None
    tensorboard: str | None = None
    profile_steps: str | None = None
    profile_dir: str = "fullshard_profile"
    peak_tflops: float | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: use one of {', '.join(PRESETS)}")
        for name in ("nproc", "steps", "seq_len", "batch_size", "log_interval", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        resume_options.validate(self)
        launcher_options.validate(self)
        self._check_optimizer_options()
        if self.seq_len > PRESETS[self.preset].max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the model's {PRESETS[self.preset].max_seq_len}")
        fsdp_options.validate(self)
        plan_options.validate(self)
        global_batch.validate(self)
        observe.validate(self)
        output_paths.validate(self)
        if self.data is not None:  # here, in the launching process: not as a worker's traceback
            try:
                text_data.check_fits(self.data, self.seq_len)
            except FileNotFoundError as e:
                raise ValueError(str(e)) from None

    def _check_optimizer_options(self) -> None:
        """--lr, --warmup, --min-lr-ratio, --weight-decay and --grad-clip (NaN fails every test)."""
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr {self.lr}: give a positive, finite learning rate")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup}: give a number of steps, 0 or more")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio}: give the final lr's fraction of --lr, 0 to 1")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay {self.weight_decay}: give a finite number, 0 or more")
        if not self.grad_clip >= 0:
            raise ValueError(f"--grad-clip {self.grad_clip}: give a max gradient norm, or 0 for no clipping")


def parse_args(argv: Sequence[str]) -> GPTJobConfig:
    """Parse command-line options into a validated GPTJobConfig (exits with a message on error)."""
    p = make_parser("fullshard train gpt", __doc__ or "")
    p.add_argument("--preset", default=GPTJobConfig.preset, help=f"model size: {', '.join(PRESETS)}")
    return config_from(p, argv, GPTJobConfig)


def config_from(p: argparse.ArgumentParser, argv: Sequence[str], cls: type) -> Any:
    """Parse ``argv`` and build ``cls`` from it, turning its ValueError into a usage error."""
    ns = p.parse_args(list(argv))
    try:
        cfg = cls(**vars(ns))
        if launch.env_world_size() is None and cfg.launcher == "torch":
            global_batch.validate(cfg, cfg.nproc)  # under torchrun or Ray: at start-up, on every rank
        return cfg
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")  # one line: the options parsed, their values did not fit
        raise  # unreachable: p.exit exits


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every byte-level language-model job takes (all but the model choice)."""
    d = GPTJobConfig()
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--nproc", type=int, default=launch.default_nproc(), help="worker processes (default: GPUs, else 2)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens (bytes) per sequence")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank and micro-batch")
    global_batch.add_arguments(p)
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps, then cosine decay")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=None, metavar="GLOB", help="UTF-8 text files (default: the stdlib sources)")
    p.add_argument("--log-interval", type=int, default=d.log_interval)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per evaluation")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    fsdp_options.add_arguments(p)
    plan_options.add_arguments(p)
    p.add_argument("--metrics-file", default=None, metavar="PATH", help="JSON lines, one per log interval")
    p.add_argument("--save-model", default=None, metavar="PATH", help="write the full state dict here")
    resume_options.add_arguments(p)
    launcher_options.add_arguments(p)
    observe.add_arguments(p)
    return p


def lr_at(step: int, cfg: GPTJobConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio x lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_model(cfg: GPTJobConfig, device: torch.device) -> nn.Module:
    """The preset's GPT, built on the meta device, one unit per Block. The FSDP1 wrapper
    materializes it shard by shard (``param_init_fn``); under ``--api fsdp2`` the program does,
    as FSDP2 programs do: ``to_empty`` on the device, then the GPT recipe on the DTensor shards
    (each rank draws its own rows, so the initial weights differ from the FSDP1 path's). Under
    ``--plan auto`` the plan wraps it (:func:`plan_options.planned_model`)."""
    model_cfg = PRESETS[cfg.preset]
    init = functools.partial(init_module, n_layers=model_cfg.n_layers)
    if cfg.plan == "auto":
        return plan_options.planned_model(cfg, device, lambda: GPT(model_cfg), lambda m: isinstance(m, Block), init)
    with torch.device("meta"):
        model = GPT(model_cfg)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if cfg.api == "fsdp1":
        return fsdp_options.shard_model(
            model, cfg, policy, param_init_fn=init, device_id=device if device.type == "cuda" else None
        )
    sharded = fsdp_options.shard_model(model, cfg, policy)
    sharded.to_empty(device=device)
    for m in sharded.modules():
        init(m)
    return sharded


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean validation loss (nats per byte) over every token of ``batches`` (collective).

    Every rank runs a forward for every batch (FSDP's all-gathers need all ranks), on every
    world-th row of it, possibly none.
    """
    group = distributed.default_group()
    rank, world = distributed.group_rank(group), distributed.group_size(group)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for x, y in batches:
            x, y = x[rank::world].to(device), y[rank::world].to(device)
            logits = model(x).float()
            total[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item() if y.numel() else 0.0
            total[1] += y.numel()
    model.train()
    distributed.all_reduce(total, group)
    return float(total[0] / total[1])


def worker(cfg: GPTJobConfig) -> dict[str, Any] | None:
    """One rank of the job. Returns the last log record on rank 0, None elsewhere."""
    device = launch.init_process_group()
    launcher_options.watchdog_on()
    try:
        return _run(cfg, device)
    finally:
        launch.destroy_process_group()


def _run(cfg: GPTJobConfig, device: torch.device) -> dict[str, Any] | None:
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, device)
    title = f"GPT preset {cfg.preset}: {PRESETS[cfg.preset].num_params / 1e6:.2f}M parameters"
    return train_loop(cfg, device, model, title, lambda: GPT(PRESETS[cfg.preset]))


def _start_step(optimizer: torch.optim.Optimizer, step: int, cfg: GPTJobConfig) -> None:
    """Set the step's learning rate, clear the gradients, label the step's distributed."""
    set_step(step + 1)
    for g in optimizer.param_groups:
        g["lr"] = lr_at(step, cfg)
    optimizer.zero_grad(set_to_none=True)


def rows_per_step(cfg: GPTJobConfig, world: int) -> int:
    """Sequences trained on per optimizer step, over all ranks."""
    return cfg.global_batch_size or cfg.batch_size * world


def train_loop(
    cfg: GPTJobConfig, device: torch.device, model: nn.Module, title: str, plain: Callable[[], nn.Module]
) -> dict[str, Any] | None:
    """Train ``model`` (byte tokens (batch, seq) -> logits (batch, seq, 256)) on the corpus.

    ``plain`` builds the unsharded model (called on the meta device, to count its FLOPs for MFU).
    Returns the last log record on rank 0, None elsewhere.
    """
    group = distributed.default_group()
    rank, world = distributed.group_rank(group), distributed.group_size(group)
    split = global_batch.plan(cfg, world)  # raises on every rank where G does not fit the world size
    rows = rows_per_step(cfg, world)
    corpus = ByteCorpus.load(cfg.data)
    val = corpus.val_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len, cfg.seed)
    if rank == 0:
        units = unit_count(model)
        micro = f" ({split.accumulation} micro-batch(es) of {cfg.batch_size} per rank)" if split else ""
        shape = f"{rows} x {cfg.seq_len} bytes per step{micro}"
        print(f"{title}, {units} FSDP units ({cfg.api}), {world} ranks, {shape}", flush=True)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=True
    )
    if rank == 0:
        print(memory_report(model, optimizer).summary(), flush=True)
    session = open_session(cfg)
    first = _resume(session, model, optimizer, cfg.steps)
    if first == cfg.steps:  # a finished run started again: nothing to train
        return _already_trained(cfg, model, val, device)
    metrics = MetricsFile(cfg.metrics_file, rank == 0, append=first > 0)
    obs = _observer(cfg, device, plain, first)
    record: dict[str, Any] | None = None
    window = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, steps, last grad norm
    start = time.perf_counter()
    for step in range(first, cfg.steps):
        _start_step(optimizer, step, cfg)
        obs.step_started(step)
        loss, norm = _train_step(cfg, model, corpus, split, step, rank, device)
        optimizer.step()
        window[0] += loss
        window[1] += 1
        window[2] = norm
        obs.step_finished(step)
        logged = (step + 1) % cfg.log_interval == 0 or step + 1 == cfg.steps
        if logged:  # before the checkpoint: a rank lost after the save must not lose this record
            obs.end_window()
            record = _log(cfg, model, optimizer, val, obs, step, window)
            record.update(elapsed_seconds=time.perf_counter() - start, global_batch_size=rows, world_size=world)
            obs.say(_line(record, cfg.steps))
            metrics.write(record)
            obs.write(record, step + 1)
            session.report(record)
        if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
            session.save(step + 1, model, optimizer, _extra(step + 1))
        if logged:
            window.zero_()
            obs.start_window()
    obs.close()
    fsdp_options.save_full_model(model, cfg.save_model)
    return record if rank == 0 else None


def _train_step(
    cfg: GPTJobConfig,
    model: nn.Module,
    corpus: ByteCorpus,
    split: global_batch.Plan | None,
    step: int,
    rank: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, backward and clipping of one step; (this rank's loss, the global grad norm)."""
    if split is None:
        x, y = corpus.batch(step, rank, cfg.batch_size, cfg.seq_len, cfg.seed)
        loss = _loss(model, x.to(device), y.to(device))
        loss.backward()
    else:  # the step's rows depend on the step and the seed, not on the world size
        x, y = corpus.batch(step, 0, split.global_batch, cfg.seq_len, cfg.seed)
        loss = global_batch.accumulate(model, split, rank, (x.to(device), y.to(device)), _loss)
    # max_norm inf: the norm is still computed (and logged) when clipping is off
    norm = fsdp_options.clip_grad_norm_(model, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    return loss.detach(), norm.detach()


def _observer(cfg: GPTJobConfig, device: torch.device, plain: Callable[[], nn.Module], first: int) -> observe.Observer:
    """The job's metrics sinks, with the model FLOPs of one sequence and the peak per rank."""
    flops = observe.model_flops(plain, lambda: torch.zeros(1, cfg.seq_len, dtype=torch.long))
    peak = observe.peak_flops(device, fsdp_options.PRECISIONS[cfg.mixed_precision] or torch.float32, cfg.peak_tflops)
    obs = observe.Observer(cfg, device, flops, peak, cfg.steps, first)
    obs.say(f"model FLOPs {flops / cfg.seq_len:,.0f} per token; peak {peak[0] / 1e12:.3g} TFLOP/s per rank ({peak[1]})")
    return obs


def _extra(step: int) -> dict[str, Any]:
    """This rank's state a checkpoint keeps besides the model and optimizer: the step, torch's
    RNG state and the stochastic rounding generators' (``--comm-quant`` int8 gradients)."""
    return {"step": step, "rng": torch.get_rng_state(), "rounding_rng": checkpoints.rounding_state()}


def _already_trained(cfg: GPTJobConfig, model: nn.Module, val: list, device: torch.device) -> dict[str, Any] | None:
    """A run whose checkpoint is at ``--steps`` already: say so, evaluate, save the model
    (``--save-model``) and return the final record on rank 0 (collective)."""
    loss = evaluate(model, val, device)
    rank = distributed.group_rank(distributed.default_group())
    if rank == 0:
        line = f"the checkpoint is at --steps {cfg.steps} already: nothing to train (raise --steps to go on)"
        print(line, flush=True)
    fsdp_options.save_full_model(model, cfg.save_model)
    return {"step": cfg.steps, "val_loss": loss} if rank == 0 else None


def _resume(session: Session, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> int:
    """Load the newest checkpoint of the session, if any; the step to continue from.

    Everything that decides the rest of the run comes back: parameters, optimizer state, the
    step (which fixes the learning rate and the data), and the RNG states, torch's and the
    stochastic rounding's (a rank that did not exist when the checkpoint was saved keeps its own:
    the job's seed, and its rank's rounding seed).

    Raises:
        ValueError: the checkpoint is past ``steps`` (``--steps``), which would train nothing.
    """
    resumed = session.resume(model, optimizer)
    if resumed is None:
        return 0
    if resumed.step > steps:
        raise ValueError(
            f"--steps {steps} is below the step of the checkpoint resumed from, {resumed.step} ({resumed.path}): "
            f"pass --steps {resumed.step} or more to go on from it, or another --checkpoint-dir to start afresh"
        )
    if "rng" in resumed.extra:
        torch.set_rng_state(resumed.extra["rng"])
    checkpoints.set_rounding_state(resumed.extra.get("rounding_rng", {}))
    if distributed.group_rank(distributed.default_group()) == 0:
        print(f"resumed from {resumed.path} at step {resumed.step}", flush=True)
    return resumed.step


def _log(
    cfg: GPTJobConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    val: list,
    obs: observe.Observer,
    step: int,
    window: torch.Tensor,
) -> dict[str, Any]:
    """The record of a log window (collective): losses, grad norm, lr, throughput, MFU, the step
    split into compute and exposed communication, memory per rank."""
    group = distributed.default_group()
    world = distributed.group_size(group)
    norm = window[2].item()  # the same on every rank: read before the sum
    distributed.all_reduce(window, group)
    steps = round(window[1].item() / world)
    sequences = steps * rows_per_step(cfg, world)
    seen = obs.window(steps, sequences, model_state_bytes(model, optimizer)["total"])
    seen["tokens_per_second"] = seen.pop("samples_per_second") * cfg.seq_len
    return {
        "step": step + 1,
        "train_loss": window[0].item() / window[1].item(),
        "val_loss": evaluate(model, val, obs.device),
        "grad_norm": norm,
        "lr": optimizer.param_groups[0]["lr"],
        **seen,
    }


def _line(r: dict[str, Any], steps: int) -> str:
    exposed = max(r["comm_exposed_seconds"])
    return (
        f"step {r['step']}/{steps}  train loss {r['train_loss']:.4f}  val loss {r['val_loss']:.4f}  "
        f"grad norm {r['grad_norm']:.3f}  {r['tokens_per_second']:,.0f} tok/s  MFU {100 * r['mfu']:.1f}%  "
        f"step {1000 * r['step_seconds']:.0f} ms (comm exposed {1000 * exposed:.0f} ms)  "
        f"{r['elapsed_seconds']:.0f} s  peak RSS per rank [{', '.join(mib(b) for b in r['peak_rss_bytes'])}]"
    )


def main(argv: Sequence[str]) -> int:
    """Entry point: run under an existing launcher (torchrun) or start ``--nproc`` workers."""
    cfg = parse_args(argv)
    code, final = launch.run_job("fullshard train gpt", worker, cfg, cfg.nproc, max_restarts=cfg.max_restarts)
    if final is not None:
        print(f"final validation loss {final['val_loss']:.4f} nats/byte after {final['step']} steps", flush=True)
    return code
