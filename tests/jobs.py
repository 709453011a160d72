"""Worker functions for launcher tests (module level so spawned workers can import them)."""

from __future__ import annotations

import os

import torch


def fail_on_rank1(message: str) -> int:
    from fullshard.comm import collectives
    from fullshard.jobs import launch

    launch.init_process_group(timeout_s=600)
    if collectives.group_rank(collectives.default_group()) == 1:
        raise ValueError(message)
    t = torch.ones(1)
    collectives.all_reduce(t, collectives.default_group())  # rank 0 would wait here for the dead rank 1
    return 0


def environment_probe(name: str) -> tuple[str | None, str | None, int]:
    """This worker's ``name`` variable, its RANK and torch's intra-op thread count."""
    return os.environ.get(name), os.environ.get("RANK"), torch.get_num_threads()


def parent_command() -> str:
    """The command line of this worker's parent process (a forkserver's, or the launcher's)."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def world_sum() -> float:
    from fullshard.comm import collectives
    from fullshard.jobs import launch

    launch.init_process_group()
    t = torch.ones(1)
    collectives.all_reduce(t, collectives.default_group())
    launch.destroy_process_group()
    return float(t.item())


def save_into(root: str) -> None:
    """Save a checkpoint of a small FSDP model under ``root`` (a test makes that fail on every rank)."""
    from fullshard import FSDP, checkpoint
    from fullshard.jobs import launch

    launch.init_process_group(timeout_s=600)
    try:
        model = FSDP(torch.nn.Linear(4, 4))
        checkpoint.save(root, 1, model)
    finally:
        launch.destroy_process_group()
