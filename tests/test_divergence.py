"""Ranks that issue different collectives are stopped before the backend pairs them, on every
rank, with one sentence naming both collectives and the rank that left the usual order.

Each case runs two ordinary steps, then one rank misbehaves at step 3, so the collectives that
meet at the divergence have different sizes (gloo would abort the process in C++ or exchange the
wrong bytes). All cases run in one pair of fresh processes, each on a process group of its own
(a diverged group is left with a collective that never completes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from torch import nn


class Block(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x))


class Net(nn.Module):
    """Units of different sizes; ``head`` is registered first, so a state dict (module order)
    gathers it first while a forward gathers ``inp`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = Block(nn.Linear(16, 4))
        self.inp = Block(nn.Linear(8, 16))
        self.layers = nn.ModuleList(
            [
                Block(nn.Linear(16, 16)),
                Block(nn.Linear(16, 16, bias=False)),
                Block(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))),
            ]
        )
        self.skip: int | None = None  # an index of ``layers`` to leave out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = layer(x)
        return self.head(x)


def _steps(case: str, rank: int, group: object) -> None:
    from fullshard import FSDP
    from fullshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    net = Net()
    model = FSDP(net, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if case == "optim_state" else 0.0)
    for step in range(1, 5):
        x = torch.randn(4, 8)
        odd = step == 3
        if case == "exit_early" and odd and rank == 1:
            return  # leaves the group (its watchdog writes a final heartbeat); its process exits next
        if case == "extra_forward" and odd and rank == 0:
            model(x)  # an evaluation forward that only rank 0 runs
        net.skip = 1 if case == "skip_unit" and odd and rank == 1 else None
        if case == "freeze" and odd and rank == 0:
            net.layers[0].inner.bias.requires_grad_(False)  # a freeze in rank-dependent code
        if case == "no_sync" and odd and rank == 1:
            with model.no_sync():  # accumulates where rank 0 reduce-scatters
                model(x).sum().backward()
        else:
            model(x).sum().backward()
        if case == "clip" and odd and rank == 0:
            model.clip_grad_norm_(1.0)
        if case == "optim_state" and odd and rank == 0:
            FSDP.optim_state_dict(model, opt)  # gathers through torch's DTensor.full_tensor()
        if case == "state_dict" and odd:
            if rank == 1:
                continue  # skips the optimizer step and the state dict: on to the next forward
            opt.step()
            model.state_dict()
        opt.step()
        opt.zero_grad()


def diverge_body(rank: int, world: int, cases: list[str], dumps: str) -> dict[str, str]:
    """Each case on a new group, with the watchdog on; the error each rank raised."""
    import os

    from fullshard.comm import flight_recorder, peers, watchdog

    os.environ["FULLSHARD_FLIGHT_RECORDER_DIR"] = dumps
    seen = {}
    for case in cases:
        group = dist.new_group([0, 1])
        flight_recorder.RECORDER.__init__(flight_recorder.RECORDER.capacity)  # a diverged group's count is off
        watchdog.enable_watchdog(timeout=10 if case == "exit_early" else 60)
        try:
            _steps(case, rank, group)
            seen[case] = "no error"
        except peers.CollectiveError as e:
            seen[case] = f"{type(e).__name__}: {e}"
        finally:
            watchdog.disable_watchdog()
    return seen


CASES = ["state_dict", "clip", "skip_unit", "extra_forward", "optim_state", "no_sync", "freeze"]


@pytest.mark.timeout(300)
def test_divergent_collectives_are_named_on_both_ranks_before_the_backend_runs_them(tmp_path: Path) -> None:
    seen = run_ranks(diverge_body, 2, [*CASES, "exit_early"], str(tmp_path), fresh=True, timeout=240)
    for case in [*CASES, "exit_early"]:
        print(f"{case}: rank 0: {seen[0][case]}\n{case}: rank 1: {seen[1][case]}")
    for case in CASES:
        assert seen[0][case] == seen[1][case], case  # the same sentence on both ranks
        assert seen[0][case].startswith("CollectiveDiverged: ranks diverged at collective #"), seen[0][case]
    state_dict, clip, skip_unit, extra, optim_state, no_sync, freeze = (seen[0][c] for c in CASES)
    assert re.search(
        r"rank 0 issued state_dict all-gather of unit 'head' \(136 bytes, step 3\), rank 1 issued forward "
        r"all-gather of unit 'inp' \(288 bytes, step 4\); rank 1 skipped ahead \(step 4 against step 3\)",
        state_dict,
    ), state_dict
    assert re.search(
        r"rank 0 issued clip all-reduce \(8 bytes, step 3\), rank 1 issued forward all-gather of unit 'inp' "
        r"\(288 bytes, step 4\); rank 1 skipped ahead \(step 4 against step 3\)",
        clip,
    ), clip
    assert re.search(
        r"rank 0 issued forward all-gather of unit 'layers.1' \(512 bytes, step 3\), rank 1 issued forward "
        r"all-gather of unit 'layers.2' \(560 bytes, step 3\); rank 1 left the usual order \(rank 0's collective is "
        r"the one that usually comes next\): rank-dependent control flow",
        skip_unit,
    ), skip_unit
    assert re.search(
        r"rank 0 issued forward all-gather of unit 'inp' \(288 bytes, step 4\), rank 1 issued backward "
        r"prefetch all-gather of unit 'layers.2' \(560 bytes, step 3\); rank 0 skipped ahead \(step 4 against "
        r"step 3\)",  # 'head', last in forward, stays gathered into backward (hooks.keeps_last_gathered)
        extra,
    ), extra
    # torch issues the gathers of the optimizer state (DTensor.full_tensor()): fullshard marks their start
    assert re.search(
        r"rank 0 issued start of optim_state_dict gather \(step 3\), rank 1 issued forward all-gather of unit 'inp' "
        r"\(288 bytes, step 4\); rank 1 skipped ahead \(step 4 against step 3\)",
        optim_state,
    ), optim_state
    assert re.search(
        r"rank 0 issued post-backward reduce-scatter of unit 'head' \(136 bytes, step 3\), rank 1 issued .*; "
        r"rank 1 left the usual order .*: one rank reduce-scatters gradients where the other does not: no_sync\(\)",
        no_sync,
    ), no_sync
    # The rank whose requires_grad changed checks the unit's new layout with the others; they, unchanged,
    # gather as before: the sentence says what changed. (Without the watchdog gloo aborts rank 0 in C++.)
    assert re.search(
        r"rank 0 issued requires_grad check all-gather of unit 'layers.0' \(2 bytes, step 3\), rank 1 issued forward "
        r"all-gather of unit 'layers.0' \(\d+ bytes, step 3\); .*: requires_grad changed on some ranks only "
        r"\(requires_grad_\(\) in rank-dependent code\?\): every rank must freeze or unfreeze the same parameters "
        r"before the same forward",
        freeze,
    ), freeze
    # A rank that leaves (its process lives on) is named with its last completed collective, exact:
    # its watchdog's final heartbeat. (A process that exits: test_watchdog.py.) Step 2 has one
    # all-gather fewer than step 1: 'head', last in forward, stays gathered into backward.
    assert seen[1]["exit_early"] == "no error"
    assert re.search(
        r"^CollectiveTimeout: rank 0 waited \d+ s \(timeout 10 s\) in all_gather #31 of group \[0,1\] \(288 bytes, "
        r"unit 'inp', forward, step 3\); not joined: rank 1 exited \(last completed: reduce_scatter #30 of group "
        r"\[0,1\] \(288 bytes, unit 'inp', post-backward reduce-scatter, step 2\)\)$",
        seen[0]["exit_early"],
    ), seen[0]["exit_early"]


def test_a_phase_that_names_its_op_is_not_followed_by_the_op_again() -> None:
    from fullshard.comm.divergence import _what

    rs = {"identity": ["reduce_scatter", "torch.float32", 9, "head", "post-backward reduce-scatter"], "nbytes": 36}
    assert _what({**rs, "step": 2}) == "post-backward reduce-scatter of unit 'head' (36 bytes, step 2)"
    ag = {"identity": ["all_gather", "torch.float32", 9, "head", "forward"], "nbytes": 36, "step": 2}
    assert _what(ag) == "forward all-gather of unit 'head' (36 bytes, step 2)"
