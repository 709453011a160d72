"""``fullshard bench gpu``: the GPT presets on one CUDA device (issue 6, section 4).

Two measures, at world size 1:

- **Throughput** (``--preset``, default 124m): the same GPT, seed and batch trained in bf16 by
  fullshard (``MixedPrecision(bfloat16)``, one FSDP unit per Block), by torch FSDP2
  (``MixedPrecisionPolicy(bfloat16)``), and unwrapped, twice: under ``torch.autocast`` with fp32
  parameters (the same numerics as FSDP's mixed precision: fp32 master weights, bf16 compute)
  and with bf16 parameters (no master copy, no casts). All four live in one process and take
  turns, ``steps`` timed steps each per round, so clock drift hits them alike; the first
  step's loss of each is kept, and they must agree (the same model and data).
- **CPU offload** (``--offload-presets``): each preset built on the meta device and trained with
  ``CPUOffload(offload_params=True)`` and bf16 compute in a fresh process, the AdamW step on
  the CPU shards; the largest that trains, and its tokens per second, answer "what fits on one
  GPU". A preset that runs out of GPU memory, or whose process dies (host memory), is a row
  saying so.

Timings go to stdout and, with ``--write``, into BENCHMARKS.md's GPU section; never into tests.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullshard.comm import collectives
from fullshard.jobs import launch
from fullshard.jobs.bench.report import machine_line

THROUGHPUT_IMPLS = ("fullshard", "torch FSDP2", "unwrapped, autocast bf16", "unwrapped, bf16 parameters")


def _tokens(vocab: int, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each int64 (batch, seq), drawn from a fixed seed."""
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
    return t[:, :-1], t[:, 1:]


def _build(impl: str, preset: str, device: torch.device) -> nn.Module:
    """The preset's GPT from seed 0 on ``device``, wrapped (or cast) for ``impl``."""
    from fullshard.engine.config import MixedPrecision
    from fullshard.frontend.fsdp1 import FullyShardedDataParallel as FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy
    from fullshard.jobs.models.gpt import GPT, PRESETS, Block

    torch.manual_seed(0)
    model = GPT(PRESETS[preset]).to(device)
    bf16 = torch.bfloat16
    if impl == "fullshard":
        mp = MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)
        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=mp,
            device_id=device if device.type == "cuda" else None,
        )
    if impl == "torch FSDP2":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
        for block in model.blocks:  # type: ignore[union-attr]
            torch_fully_shard(block, mp_policy=policy)
        return torch_fully_shard(model, mp_policy=policy)  # type: ignore[return-value]
    if impl == "unwrapped, bf16 parameters":
        return model.to(bf16)
    return model


def _optimizer(params: Any, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, autocast: bool
) -> torch.Tensor:
    """One AdamW step; returns the loss (a 0-dim tensor, not synchronized)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step: Callable[[], torch.Tensor], n: int, device: torch.device) -> list[float]:
    """Seconds of each of ``n`` steps, the device synchronized around each."""
    out = []
    for _ in range(n):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def throughput_worker(preset: str, batch: int, seq: int, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """World size 1: every throughput implementation in this process, taking turns.

    Returns {impl: {"times": [s, ...], "first_loss": float}} plus "device" and "tokens" (per step).
    Raises RuntimeError when run at a world size other than 1.
    """
    device = launch.init_process_group()
    try:
        if collectives.group_size(collectives.default_group()) != 1:
            raise RuntimeError("bench gpu runs at world size 1: --nproc 1")
        x, y = _tokens(256, batch, seq, device)
        jobs = {}
        for impl in THROUGHPUT_IMPLS:
            model = _build(impl, preset, device)
            opt = _optimizer(model.parameters(), device)
            autocast = impl == "unwrapped, autocast bf16"
            first = float(_train_step(model, opt, x, y, autocast).item())
            jobs[impl] = (functools.partial(_train_step, model, opt, x, y, autocast), first)
        res: dict[str, Any] = {impl: {"times": [], "first_loss": first} for impl, (_, first) in jobs.items()}
        for r in range(rounds):
            order = THROUGHPUT_IMPLS if r % 2 == 0 else THROUGHPUT_IMPLS[::-1]
            for impl in order:
                step = jobs[impl][0]
                _time_steps(step, warmup, device)
                res[impl]["times"] += _time_steps(step, steps, device)
        del jobs
        res["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        res["tokens"] = batch * seq
        return res
    finally:
        launch.destroy_process_group()


def offload_worker(preset: str, batch: int, seq: int, steps: int, warmup: int) -> dict[str, Any]:
    """World size 1: ``preset`` built on meta, CPU offload + bf16, AdamW on the CPU shards.

    Returns {"times", "build_s", "peak_gpu_bytes", "peak_rss_bytes", "state_bytes", "params"} or
    {"error": message} when the device runs out of memory.
    """
    from fullshard.engine.config import CPUOffload, MixedPrecision
    from fullshard.frontend.fsdp1 import FullyShardedDataParallel as FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy
    from fullshard.jobs.models.gpt import GPT, PRESETS, Block, init_module
    from fullshard.plan.memory import model_state_bytes, peak_rss_bytes

    device = launch.init_process_group()
    try:
        cfg = PRESETS[preset]
        start = time.perf_counter()
        with torch.device("meta"):
            model = GPT(cfg)
        bf16 = torch.bfloat16
        fsdp = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            cpu_offload=CPUOffload(offload_params=True),
            mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16),
            param_init_fn=functools.partial(init_module, n_layers=cfg.n_layers),
            device_id=device if device.type == "cuda" else None,
        )
        opt = _optimizer(fsdp.parameters(), torch.device("cpu"))
        build_s = time.perf_counter() - start
        x, y = _tokens(cfg.vocab_size, batch, seq, device)
        step = functools.partial(_train_step, fsdp, opt, x, y, False)
        try:
            _time_steps(step, warmup, device)
            times = _time_steps(step, steps, device)
        except torch.OutOfMemoryError as e:
            return {"error": f"out of GPU memory: {str(e).splitlines()[0][:160]}", "params": cfg.num_params}
        return {
            "times": times,
            "build_s": build_s,
            "params": cfg.num_params,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
            "peak_rss_bytes": peak_rss_bytes(),
            "state_bytes": model_state_bytes(fsdp, opt)["total"],
        }
    finally:
        launch.destroy_process_group()


def throughput_table(res: dict[str, Any]) -> list[str]:
    """Markdown rows: median step, tokens/s, and the ratio of throughput to each unwrapped run."""
    med = {impl: statistics.median(res[impl]["times"]) for impl in THROUGHPUT_IMPLS}
    base_a, base_b = med["unwrapped, autocast bf16"], med["unwrapped, bf16 parameters"]
    rows = [
        "| implementation | step (ms) | tokens/s | throughput vs unwrapped autocast | vs unwrapped bf16 "
        "parameters | first-step loss |",
        "|---|---|---|---|---|---|",
    ]
    for impl in THROUGHPUT_IMPLS:
        rows.append(
            f"| {impl} | {med[impl] * 1e3:.1f} | {res['tokens'] / med[impl]:,.0f} | {base_a / med[impl]:.3f}x | "
            f"{base_b / med[impl]:.3f}x | {res[impl]['first_loss']:.4f} |"
        )
    return rows


def offload_table(rows: list[tuple[str, dict[str, Any]]], tokens: int) -> list[str]:
    """Markdown rows, one per preset: tokens/s and memory, or why it did not train."""
    out = [
        "| preset | parameters | step (s) | tokens/s | peak GPU memory (GiB) | peak host RSS (GiB) | "
        "model state on host (GiB) | build (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset, r in rows:
        if "error" in r:
            out.append(f"| {preset} | {r['params'] / 1e9:.2f}B | did not train: {r['error']} | | | | | |")
            continue
        s = statistics.median(r["times"])
        out.append(
            f"| {preset} | {r['params'] / 1e9:.2f}B | {s:.2f} | {tokens / s:,.0f} | "
            f"{r['peak_gpu_bytes'] / 2**30:.1f} | "
            f"{r['peak_rss_bytes'] / 2**30:.1f} | {r['state_bytes'] / 2**30:.1f} | {r['build_s']:.0f} |"
        )
    return out


def run(
    preset: str,
    offload_presets: Sequence[str],
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    rounds: int,
    offload_batch: int,
    offload_steps: int,
) -> str:
    """Run both measures; return the markdown section."""
    res = launch.launch(throughput_worker, (preset, batch, seq, steps, warmup, rounds), 1)[0]
    device = "cuda" if res["device"] != "cpu" else "cpu"
    lines = [
        f"Machine: {machine_line(device)}; world size 1.",
        "",
        f"Throughput: preset {preset}, batch {batch} x {seq} tokens, bf16 compute, fused AdamW; median of "
        f"{steps * rounds} timed steps per implementation ({rounds} rounds of {warmup} warm-up + {steps} timed steps, "
        "the implementations taking turns in one process).",
        "",
        *throughput_table(res),
        "",
    ]
    f = statistics.median(res["unwrapped, autocast bf16"]["times"]) / statistics.median(res["fullshard"]["times"])
    lines += [
        f"- fullshard vs the same model unwrapped (autocast bf16): {f:.3f}x throughput "
        f"(target at least 0.97x): {'met' if f >= 0.97 else 'not met'}",
        "",
    ]
    rows: list[tuple[str, dict[str, Any]]] = []
    for p in offload_presets:
        try:
            r = launch.launch(offload_worker, (p, offload_batch, seq, offload_steps, 1), 1)[0]
        except launch.WorkerFailed as e:
            from fullshard.jobs.models.gpt import PRESETS

            r = {"error": f"the worker died ({str(e).splitlines()[0][:120]})", "params": PRESETS[p].num_params}
        rows.append((p, r))
        print(f"offload {p}: {r}", flush=True)
    if rows:
        trained = [p for p, r in rows if "error" not in r]
        lines += [
            f"CPU offload: `CPUOffload(offload_params=True)`, bf16 compute, fused AdamW on the host shards, "
            f"batch {offload_batch} x {seq} tokens, median of {offload_steps} steps after 1 warm-up; "
            "each preset in a fresh process, built on the meta device.",
            "",
            *offload_table(rows, offload_batch * seq),
            "",
            f"- largest preset that trains on this GPU with CPU offload: {trained[-1] if trained else 'none'}",
            "",
        ]
    return "\n".join(lines)
