"""The jobs' observability pieces that need no process group: FLOP counting, the exposed
communication clock, and option checks. The job-level read-back (TensorBoard events, profiler
trace, metrics records) is in test_gpt_job.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fullshard.comm import exposed_comm
from fullshard.jobs.train import observe


def test_model_flops_counts_forward_and_backward_matmuls_exactly() -> None:
    # (2, 4) @ (4, 3): forward 2*2*4*3 = 48 FLOPs; backward: the weight's gradient, 48 (the input
    # needs none, as a model's token ids need none).
    assert observe.model_flops(lambda: nn.Linear(4, 3, bias=False), lambda: torch.zeros(2, 4)) == 96
    two = observe.model_flops(
        lambda: nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 5, bias=False)), lambda: torch.zeros(2, 4)
    )
    assert two == 96 + 3 * 2 * 2 * 3 * 5  # the second layer also computes its input's gradient


def test_model_flops_allocates_nothing() -> None:
    # 2**36 float32 parameters (256 GiB) would not fit: counted on the meta device all the same.
    flops = observe.model_flops(lambda: nn.Linear(2**18, 2**18, bias=False), lambda: torch.zeros(1, 2**18))
    assert flops == 2 * 2 * 2**36


def test_exposed_time_counts_nested_blocking_regions_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 11.0, 13.0, 20.0])  # outer enter, (inner enter/exit not read), outer exit
    monkeypatch.setattr(exposed_comm.time, "perf_counter", lambda: next(clock))
    before = exposed_comm.exposed_seconds()
    with exposed_comm.blocked(lambda: "outer"):
        with exposed_comm.blocked(lambda: "inner"):
            pass
    assert exposed_comm.exposed_seconds() - before == 1.0  # 11.0 - 10.0: the inner region read no clock
    with exposed_comm.blocked(lambda: "next"):
        pass
    assert exposed_comm.exposed_seconds() - before == 8.0


def test_profiler_ranges_only_while_profiling() -> None:
    assert exposed_comm.open_range("fullshard::unit forward x") is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        token = exposed_comm.open_range("fullshard::unit forward x")
        torch.ones(3).sum()
        exposed_comm.close_range(token)
    assert "fullshard::unit forward x" in {e.name for e in prof.events()}


@pytest.mark.parametrize(
    ("text", "message"),
    [("5", "give A:B"), ("a:b", "give A:B"), ("3:2", "need 1 <= A <= B"), ("0:2", "need 1 <= A <= B")],
)
def test_profile_steps_are_checked(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        observe.parse_profile_steps(text)
    assert observe.parse_profile_steps("5:7") == (5, 7)


class _ReadsValues(nn.Module):
    """Reads a tensor's value in forward, as some transformers models' mask code does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (ids[:, -1] == 0).all().item():
            return self.embed(ids) * 2
        return self.embed(ids)


def test_model_flops_falls_back_to_six_n_per_token_when_forward_reads_values() -> None:
    flops = observe.model_flops(_ReadsValues, lambda: torch.zeros(2, 3, dtype=torch.long))
    assert flops == 6 * 40 * 6  # 40 parameters, 2 x 3 tokens
    with pytest.raises(RuntimeError, match="meta"):
        observe.model_flops(lambda: _Floats(), lambda: torch.zeros(2, 3))


class _Floats(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()


@pytest.mark.timeout(200)
def test_bench_recorder_prints_every_setting() -> None:
    """``fullshard bench recorder`` times its three settings at 2 ranks, a collective the
    divergence check did not predict, and the three settings at 1 rank (its numbers are for
    BENCHMARKS.md, not asserted here)."""
    import subprocess
    import sys
    from pathlib import Path

    cmd = [str(Path(sys.executable).parent / "fullshard"), "bench", "recorder", "--calls", "20", "--rounds", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    settings = [
        "off (FULLSHARD_FLIGHT_RECORDER_SIZE=0, no watchdog)",
        "flight recorder (library default)",
        "recorder + watchdog + divergence check (fullshard train)",
    ]
    names = [row.split("|")[1].strip() for row in rows]
    unpredicted = "divergence check, a collective it did not predict (asks the others)"
    assert names == ["setting", *settings, unpredicted, "setting", *settings], r.stdout
    assert all(float(row.split("|")[2]) > 0 for row in rows if not row.startswith("| setting"))
