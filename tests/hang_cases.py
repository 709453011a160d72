"""Programs that would hang, at 2 ranks on gloo: ``torchrun --nproc-per-node 2 tests/hang_cases.py CASE``, or
``python tests/hang_cases.py CASE --launcher fullshard`` (``fullshard train``'s launcher). Run by test_watchdog.py.

Rank 1 misbehaves in a different way in each CASE; with the watchdog on (``FULLSHARD_WATCHDOG=1``)
the job must stop within seconds of ``FULLSHARD_COLLECTIVE_TIMEOUT`` and say what is stuck, or at
once when the ranks' collectives stop matching or a rank leaves.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

from fullshard import FullyShardedDataParallel as FSDP
from fullshard.jobs import launch
from fullshard.wrap import ModuleWrapPolicy


class Net(nn.Module):
    def __init__(self, width: int, skip_on_rank: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.skip_on_rank = skip_on_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == 1 and self.skip_on_rank == int(os.environ["RANK"]):
                continue  # rank-conditional model code
            x = torch.relu(layer(x))
        return x


def data(rank: int, case: str, step: int) -> torch.Tensor:
    if case == "slow_data" and rank == 1 and step == 2:
        time.sleep(120)  # a data loader that stalls
    return torch.randn(4, 16)


def main(case: str) -> None:
    launch.init_process_group()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    width = 24 if case == "different_model" and rank == 1 else 16
    net = Net(16, skip_on_rank=1 if case == "skip_forward" else None)
    if width != 16:
        net.layers[2] = nn.Linear(16, 16, bias=False)  # a different model on rank 1
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        x = data(rank, case, step)
        loss = model(x).sum()
        if case == "return_before_backward" and rank == 1 and step == 2:
            time.sleep(120)  # returned from the step early: the rest of its program
            return
        if case == "sigkill" and rank == 1 and step == 3:  # steady state: collectives as predicted
            os.kill(os.getpid(), 9)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if case == "exit_early" and rank == 1 and step == 2:
            launch.destroy_process_group()  # leaves a step early: its process ends here
            return
    time.sleep(120)  # finished early while the other rank still waits
    launch.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2:] == ["--launcher", "fullshard"]:
        try:
            launch.launch(main, (sys.argv[1],), 2)
        except launch.WorkerFailed as e:
            print(f"hang_cases: {e}", file=sys.stderr)
            sys.exit(1)
    else:
        main(sys.argv[1])
