"""``fullshard bench estimate``: the predicted peak against the measured one on real steps.

Each configuration (GPT presets and the MNIST Net x sharding strategy x activation
checkpointing x mixed precision x world size) is predicted with
:func:`~fullshard.plan.peak.estimate_peak` and measured: the job's own model, wrapping and
optimizer train three steps in ``world`` fresh processes under
:class:`~fullshard.plan.tracker.LiveTensorBytes` (everything from the model's
construction on is seen), and the third step's peak on rank 0 is the measurement (the first
steps create the optimizer state and fill the buffer pool). Peak RSS above the process's
baseline before the model is built is reported beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullshard.jobs import launch
from fullshard.plan.memory import peak_rss_bytes
from fullshard.plan.peak import estimate_peak
from fullshard.plan.tracker import LiveTensorBytes


def _wide() -> Any:
    from fullshard.jobs.models.gpt import GPTConfig

    return GPTConfig(d_model=512, n_layers=4, n_heads=8)


@dataclasses.dataclass(frozen=True)
class Config:
    """One validated configuration."""

    model: str  # "gpt-tiny", "gpt-wide" (memory-bound: d_model 512, 4 layers), "mnist" or an HF config
    world: int
    strategy: str = "full_shard"
    ac: bool = False
    precision: str = "none"
    batch: int = 16

    def describe(self) -> str:
        extras = (" +AC" if self.ac else "") + (f" {self.precision}" if self.precision != "none" else "")
        return f"{self.model} x{self.world} {self.strategy}{extras}"


CONFIGS = [
    *(Config("gpt-tiny", w, ac=ac) for w in (1, 2, 4) for ac in (False, True)),
    Config("gpt-tiny", 2, precision="bf16"),
    Config("gpt-tiny", 2, ac=True, precision="bf16"),
    Config("gpt-tiny", 2, strategy="shard_grad_op"),
    *(Config("mnist", w, batch=64) for w in (1, 2, 4)),
    Config("gpt-wide", 2, batch=2),
    Config("gpt-wide", 2, strategy="shard_grad_op", batch=2),
    Config("gpt-wide", 4, batch=2),
    *(Config(hf, 2, ac=ac) for hf in ("llama-tiny", "gpt2-tiny") for ac in (False, True)),
    Config("llama-tiny", 4),
]
HF_MODELS = ("llama-tiny", "gpt2-tiny")  # the HF job's configs (transformers)


def gpt_parts(c: Config) -> tuple[Any, Any, Any, Any]:
    """(make_model, example, loss_fn, is_unit) of the GPT job at ``c``'s batch (128 tokens)."""
    from fullshard.jobs.models.gpt import GPT, PRESETS, Block

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())

    def example() -> Any:
        return torch.zeros(c.batch, 128, dtype=torch.long), torch.zeros(c.batch, 128, dtype=torch.long)

    shape = PRESETS["tiny"] if c.model == "gpt-tiny" else _wide()
    return (lambda: GPT(shape)), example, loss, (lambda m: isinstance(m, Block))


def mnist_parts(c: Config) -> tuple[Any, Any, Any, Any]:
    """(make_model, example, loss_fn, is_unit) of the MNIST job (fc1 is its one unit)."""
    from fullshard.jobs.models.net import Net

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.nll_loss(model(x).float(), y, reduction="sum")

    def example() -> Any:
        return torch.zeros(c.batch, 1, 28, 28), torch.zeros(c.batch, dtype=torch.long)

    return Net, example, loss, (lambda m: sum(p.numel() for p in m.parameters()) >= 20000 and isinstance(m, nn.Linear))


def optimizer_of(c: Config) -> str:
    """The job's optimizer for ``c``: Adadelta for MNIST, AdamW (fused) for the language models."""
    return "adadelta" if c.model == "mnist" else "adamw"


def hf_parts(c: Config) -> tuple[Any, Any, Any, Any]:
    """(make_model, example, loss_fn, is_unit) of the HF job at ``c``'s batch (128 tokens)."""
    from fullshard.jobs.train.hf import hf_model
    from fullshard.jobs.train.plan_options import lm_parts

    make, layers = hf_model(c.model)
    return (make, *lm_parts(c.batch, 128), lambda m: type(m).__name__ in layers)


def _parts(c: Config) -> tuple[Any, Any, Any, Any]:
    if c.model in HF_MODELS:
        return hf_parts(c)
    return gpt_parts(c) if c.model.startswith("gpt") else mnist_parts(c)


def predict(c: Config) -> Any:
    """The estimate of rank 0's peak for ``c``."""
    make, example, loss, is_unit = _parts(c)
    dtype = torch.bfloat16 if c.precision == "bf16" else None
    return estimate_peak(
        make,
        example,
        loss,
        is_unit,
        c.world,
        param_dtype=dtype,
        checkpoint=is_unit if c.ac else None,
        optimizer=optimizer_of(c),
        sharding_strategy=c.strategy,
        backend="nccl" if torch.cuda.is_available() else "gloo",
    )


def _build(c: Config, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from fullshard.jobs.train import fsdp_options

    if c.model == "gpt-tiny":
        from fullshard.jobs.train.gpt import GPTJobConfig, build_model

        cfg = GPTJobConfig(
            activation_checkpointing=c.ac, sharding_strategy=c.strategy, mixed_precision=c.precision, nproc=c.world
        )
        model = build_model(cfg, device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if c.model in HF_MODELS:
        from fullshard.jobs.train.hf import HFJobConfig, hf_model, shard_hf

        hcfg = HFJobConfig(
            config=c.model, activation_checkpointing=c.ac, sharding_strategy=c.strategy, mixed_precision=c.precision
        )
        make, layers = hf_model(c.model)
        model = shard_hf(make().to(device), layers, hcfg)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if c.model == "gpt-wide":  # no preset: built whole on the device, wrapped as the job wraps
        from fullshard.frontend.wrap import transformer_auto_wrap_policy
        from fullshard.jobs.models.gpt import GPT, Block
        from fullshard.jobs.train.gpt import GPTJobConfig

        cfg = GPTJobConfig(sharding_strategy=c.strategy, mixed_precision=c.precision, nproc=c.world)
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        model = fsdp_options.shard_model(GPT(_wide()).to(device), cfg, policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    from fullshard.frontend.wrap import size_based_auto_wrap_policy
    from fullshard.jobs.models.net import Net
    from fullshard.jobs.train.mnist import MnistConfig

    mcfg = MnistConfig(sharding_strategy=c.strategy, mixed_precision=c.precision, nproc=c.world)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=mcfg.min_num_params)
    model = fsdp_options.shard_model(Net().to(device), mcfg, policy)
    return model, torch.optim.Adadelta(model.parameters(), lr=1.0)


def _measure_worker(c: Config) -> tuple[int, int]:
    """(rank's third-step peak live tensor bytes, peak RSS growth in bytes)."""
    device = launch.init_process_group()
    try:
        _, example, loss_fn, _ = _parts(c)
        rss0 = peak_rss_bytes()
        with LiveTensorBytes() as live:
            torch.manual_seed(0)
            model, opt = _build(c, device)
            for _ in range(3):
                batch = tuple(t.random_(0, 10) for t in example())
                live.reset_peak()
                loss_fn(model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return live.peak, peak_rss_bytes() - rss0
    finally:
        launch.destroy_process_group()


def compare(c: Config) -> tuple[Any, int, int]:
    """(the estimate, the measured peak live tensor bytes of rank 0, its peak RSS growth) for ``c``."""
    peak, rss = launch.launch(_measure_worker, (c,), c.world, env=launch.BENCH_ENV)[0]
    return predict(c), peak, rss


def report(configs: list[Config] | None = None) -> list[str]:
    """Predict and measure every configuration; markdown lines of the table (MiB, errors in %)."""
    rows = [
        "| configuration | predicted peak (MiB) | measured peak (MiB) | error | at | peak RSS growth (MiB) | "
        "predicted: shards / grads / optimizer / gathered / grad buffer / activations (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for c in configs or CONFIGS:
        e, peak, rss = compare(c)
        err = (e.total - peak) / peak
        worst = max(worst, abs(err))
        parts = (e.shards, e.gradients, e.optimizer, e.gathered, e.gradient_buffer, e.activations)
        rows.append(
            f"| {c.describe()} | {e.total / 2**20:.2f} | {peak / 2**20:.2f} | {100 * err:+.1f}% | {e.moment} | "
            f"{rss / 2**20:.0f} | {' / '.join(f'{p / 2**20:.2f}' for p in parts)} |"
        )
    rows.append(f"\nWorst error {100 * worst:.1f}% over {len(configs or CONFIGS)} configurations (goal: 5%).")
    return rows
