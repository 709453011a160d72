"""The workloads of ``fullshard bench compare`` and how each implementation wraps them.

A workload is a model, its optimizer and one batch per rank, built from a fixed seed, so every
implementation trains the same thing. The implementations: fullshard's FSDP1 wrapper
("fullshard"), its fully_shard front end (:data:`FULLY_SHARD`), torch FSDP2, DDP, and
:data:`FLOOR`, each rank training its own replica; on request, the FSDP1 wrapper with quantized
communication (:data:`QUANTIZED`). Each FSDP implementation wraps the same
modules as units (:func:`units`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullshard.engine.config import CommQuantization
from fullshard.frontend.fsdp1 import FullyShardedDataParallel as FSDP

# The workloads of the comparison (issue "benchmarks against torch FSDP2 and DDP").
COMPARE_WORKLOADS: dict[str, dict[str, Any]] = {
    "compute": {"d_model": 256, "n_layers": 4, "n_heads": 4, "vocab": 256, "batch": 8, "seq": 128, "tied": True},
    "memory": {"d_model": 1024, "n_layers": 8, "n_heads": 16, "vocab": 32000, "batch": 1, "seq": 16, "tied": False},
    "mnist": {"batch": 64},  # the tutorial's CNN on the bundled MNIST images, Adadelta
    "tiny": {
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 2,
        "vocab": 256,
        "batch": 2,
        "seq": 16,
        "tied": True,
    },  # for tests
}
FULLY_SHARD = "fullshard fully_shard"  # the FSDP2 front end: DTensor parameters, torch's optimizer on them
IMPLEMENTATIONS = ("fullshard", FULLY_SHARD, "torch FSDP2", "DDP")
# The FSDP1 wrapper with quantized communication: a row of its own when `bench compare
# --comm-quant SPEC` names one (SPEC as the training jobs' --comm-quant).
QUANTIZED = "fullshard quantized"
FLOOR = "no communication"  # each rank trains its own replica: the compute and optimizer floor
_Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)
_Loss = Callable[[nn.Module, _Batch], torch.Tensor]


@dataclasses.dataclass
class Job:
    """One implementation of a workload on this rank, ready to step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: _Batch
    loss: _Loss
    items: int  # tokens or samples per rank per step
    params: int
    largest_unit_bytes: int


def unit_modules(workload: str, model: nn.Module) -> list[nn.Module]:
    """The modules each FSDP implementation wraps as units below the root, outermost last."""
    if workload == "mnist":
        return [model.fc1]  # type: ignore[list-item]  # what the tutorial's size policy (20k) picks
    return list(model.blocks)  # type: ignore[arg-type]


def build_job(workload: str, impl: str, device: torch.device, rank: int, comm_quant: str | None = None) -> Job:
    """Build the model, wrap it for ``impl``, and make its optimizer and this rank's batch.

    Args:
        workload: a key of :data:`COMPARE_WORKLOADS`.
        impl: one of :data:`IMPLEMENTATIONS`, :data:`QUANTIZED` or :data:`FLOOR`.
        device: where the model and batch live.
        rank: this rank; seeds its batch (the model's seed is the same on every rank).
        comm_quant: for :data:`QUANTIZED`, the quantization spec
            (:meth:`fullshard.CommQuantization.from_spec`).
    """
    w = COMPARE_WORKLOADS[workload]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + rank)
    if workload == "mnist":
        model, batch, loss, items = _mnist(w, device, g)
    else:
        model, batch, loss, items = _gpt(w, device, g)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    units = unit_modules(workload, model)
    unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]
    root_bytes = params * 4 - sum(unit_bytes)
    largest = max(unit_bytes + [root_bytes])
    model = wrap(impl, model, units, device, comm_quant)
    if workload == "mnist":
        optimizer: torch.optim.Optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Job(model, optimizer, batch, loss, items, params, largest)


def _mnist(w: dict[str, Any], device: torch.device, g: torch.Generator) -> tuple[nn.Module, _Batch, _Loss, int]:
    """The tutorial's CNN, a batch of the bundled MNIST images, its loss, samples per step."""
    from fullshard.jobs.data import mnist as mnist_data
    from fullshard.jobs.models.net import Net

    model = Net().to(device)
    train, _ = mnist_data.load_bundled()
    idx = torch.randperm(len(train), generator=g)[: w["batch"]]
    x, y = train[idx]

    def loss(m: nn.Module, b: _Batch) -> torch.Tensor:
        return F.nll_loss(m(b[0]), b[1])

    return model, (x.to(device), y.to(device)), loss, w["batch"]


def _gpt(w: dict[str, Any], device: torch.device, g: torch.Generator) -> tuple[nn.Module, _Batch, _Loss, int]:
    """A GPT of the workload's shape, a batch of random tokens, its loss, tokens per step."""
    from fullshard.jobs.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(
        d_model=w["d_model"],
        n_layers=w["n_layers"],
        n_heads=w["n_heads"],
        vocab_size=w["vocab"],
        max_seq_len=max(w["seq"], 16),
        tie_embeddings=w["tied"],
    )
    model = GPT(cfg).to(device)
    tokens = torch.randint(0, w["vocab"], (w["batch"], w["seq"] + 1), generator=g).to(device)

    def loss(m: nn.Module, b: _Batch) -> torch.Tensor:
        return F.cross_entropy(m(b[0]).float().flatten(0, 1), b[1].flatten())

    return model, (tokens[:, :-1], tokens[:, 1:]), loss, w["batch"] * w["seq"]


def wrap(
    impl: str, model: nn.Module, units: list[nn.Module], device: torch.device, comm_quant: str | None = None
) -> nn.Module:
    """``model`` wrapped for ``impl``, with ``units`` as the FSDP units below the root (for
    :data:`QUANTIZED`, communicating as the spec ``comm_quant`` says)."""
    if impl in ("fullshard", QUANTIZED):
        chosen = {id(u) for u in units}
        quant = CommQuantization.from_spec(comm_quant or "on") if impl == QUANTIZED else None
        return FSDP(
            model,
            auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or id(module) in chosen,
            comm_quantization=quant,
        )
    if impl in ("torch FSDP2", FULLY_SHARD):
        if impl == FULLY_SHARD:
            from fullshard.frontend.fully_shard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        for unit in units:
            fully_shard(unit)
        return fully_shard(model)  # type: ignore[return-value]
    if impl == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model  # FLOOR: no wrapper, no communication


def step(job: Job) -> None:
    """One training step of ``job``: zero the gradients, forward and backward, optimizer step."""
    job.optimizer.zero_grad()
    job.loss(job.model, job.batch).backward()
    job.optimizer.step()
