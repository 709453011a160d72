"""``fullshard bench save``: the time of a checkpoint save, and what its checksums cost.

A GPT of each shape, wrapped one unit per block (FSDP1 wrapper) at ``--nproc`` ranks, with AdamW
state after one step, is saved ``--rounds`` times each way, the two taking turns: torch's
``dcp.save`` of the same sharded state alone (the floor), and ``fullshard.checkpoint.save``
(claims, extra files, ``dcp.save``, the checksums, the manifest, the rename). After each
fullshard save every rank hashes its own files again exactly as the save did (from the page
cache, as inside the save): that time over the save's is what the checksums cost. Times are the
slowest rank's, medians over the rounds.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fullshard.comm import collectives
from fullshard.jobs import launch

SHAPES: dict[str, dict[str, Any]] = {  # the memory-bound GPTs of BENCHMARKS.md
    "wide": {"d_model": 512, "n_layers": 4, "n_heads": 8},  # gpt-wide of the planner's sections
    "memory": {"d_model": 1024, "n_layers": 8, "n_heads": 16, "vocab_size": 32000, "tie_embeddings": False},
}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    collectives.all_reduce_max(t, collectives.default_group())
    return float(t.item())


def _timed(fn: Any) -> tuple[float, Any]:
    collectives.barrier(collectives.default_group())
    start = time.perf_counter()
    result = fn()
    return _slowest(time.perf_counter() - start), result


def _model(shape: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    from fullshard.frontend.fsdp1 import FullyShardedDataParallel as FSDP
    from fullshard.frontend.wrap import transformer_auto_wrap_policy
    from fullshard.jobs.models.gpt import GPT, Block, GPTConfig

    cfg = GPTConfig(**SHAPES[shape])
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(GPT(cfg), auto_wrap_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randint(0, 256, (1, 16))).float().mean().backward()
    opt.step()
    return model, opt, cfg.num_params


def save_worker(shape: str, rounds: int, where: str) -> dict[str, Any] | None:
    """One rank: median seconds of dcp.save, checkpoint.save and the checksums (rank 0 returns them)."""
    import torch.distributed.checkpoint as dcp

    from fullshard.state import checkpoint, checkpoint_manifest
    from fullshard.state.checkpoint_state import sharded

    launch.init_process_group()
    torch.set_num_threads(1)
    try:
        rank = collectives.group_rank(collectives.default_group())
        model, opt, params = _model(shape)
        times: dict[str, list[float]] = {"dcp": [], "save": [], "hash": []}
        nbytes = 0
        for r in range(rounds):
            plain = Path(where) / f"dcp_{r}"
            times["dcp"].append(_timed(lambda: dcp.save(sharded(model, opt), checkpoint_id=str(plain)))[0])
            seconds, directory = _timed(lambda: checkpoint.save(where, r, model, opt, keep=1))
            times["save"].append(seconds)
            manifest = checkpoint_manifest.read(directory)
            assert manifest is not None
            mine = {n for n, e in manifest.files.items() if e.rank == rank}
            nbytes = sum(manifest.files[n].size for n in mine)
            times["hash"].append(_timed(lambda: checkpoint_manifest.entries(directory, mine, rank))[0])
            collectives.barrier(collectives.default_group())
            if rank == 0:
                shutil.rmtree(plain)
        medians = {k: statistics.median(v) for k, v in times.items()}
        return {"shape": shape, "params": params, "bytes": nbytes, **medians} if rank == 0 else None
    finally:
        launch.destroy_process_group()


def report(shapes: list[str], rounds: int, nproc: int, where: str | None) -> list[str]:
    """The markdown lines of ``fullshard bench save``: one row per shape."""
    lines = [
        f"checkpoint save of GPTs (FSDP1 wrapper, AdamW state) at {nproc} ranks, torch {torch.__version__}, "
        f"median of {rounds} rounds, slowest rank",
        "| shape | parameters | bytes per rank (rank 0) | dcp.save (s) | checkpoint.save (s) | checksums (s) "
        "| checksums / checkpoint.save | checksums / dcp.save |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape in shapes:
        base = Path(tempfile.mkdtemp(prefix="fullshard-bench-save-", dir=where))
        try:
            row = launch.launch(save_worker, (shape, rounds, str(base)), nproc)[0]
        finally:
            shutil.rmtree(base, ignore_errors=True)
        lines.append(
            f"| {shape} | {row['params'] / 1e6:.1f}M | {row['bytes'] / 2**20:,.1f} MiB | {row['dcp']:.3f} "
            f"| {row['save']:.3f} | {row['hash']:.4f} | {100 * row['hash'] / row['save']:.1f}% "
            f"| {100 * row['hash'] / row['dcp']:.1f}% |"
        )
    return lines
