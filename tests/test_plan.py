"""The step-time model and the planner: schedule arithmetic, fitting, candidates, plans, the CLI."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from plan_jobs import check_plan_auto
from torch import nn

from fullshard.plan.calibrate import BlockTime, CommModel, Link, _fit
from fullshard.plan.simulate import UnitCost, merge_costs, simulate_step

MS = 1e-3
CPU = torch.device("cpu")
BIN = Path(sys.executable).parent
COMM = CommModel(2, "gloo", all_gather=Link(0.0, MS), reduce_scatter=Link(0.0, 2 * MS), all_reduce=Link(MS, MS))


def _unit(name: str, fwd: float, bwd: float, nbytes: int, **kw: bool) -> UnitCost:
    return UnitCost(name, BlockTime(fwd * MS, bwd * MS), gather_bytes=nbytes, reduce_bytes=nbytes, **kw)


def test_fit_recovers_a_line_and_keeps_coefficients_non_negative() -> None:
    link = _fit([(1000, 0.002), (2000, 0.003), (4000, 0.005)])
    assert link.latency == pytest.approx(0.001) and link.seconds_per_byte == pytest.approx(1e-6)
    assert _fit([(1000, 0.005), (2000, 0.004)]).seconds_per_byte == 0.0
    assert Link(1.0, 1.0).seconds(0) == 0.0  # nothing to move costs nothing


def test_schedule_without_prefetch_waits_for_every_gather() -> None:
    # Root: 2 ms forward (1 before, 1 after the units), 4 ms backward; gathers of 1 / 3 / 3 ms.
    root = _unit("<root>", 2, 4, 1)
    units = [_unit("a", 10, 20, 3), _unit("b", 10, 20, 3)]
    t = simulate_step(root, units, COMM, backward_prefetch=None)
    # forward: root gather 1, root 1, gather a 3, a 10, gather b 3, b 10, root 1
    fwd = 1 + 1 + 3 + 10 + 3 + 10 + 1
    now = fwd + 2  # the root's backward half after the units
    now += 3 + 20  # gather b (network idle), b's backward
    rs_b = now + 6  # reduce-scatter of b: 3 bytes x 2 ms
    now = max(now, rs_b) + 3  # a's gather queues behind b's reduce-scatter on the one network
    now += 20  # a's backward; b's reduction already done, a's issued
    rs_a = now + 6
    now += 2  # the root's remaining backward
    now = max(now, rs_a) + 2  # the root's reduce-scatter (1 byte)
    assert t.seconds == pytest.approx(now * MS)
    assert t.compute == pytest.approx((2 + 4 + 30 + 30) * MS)
    assert t.exposed_comm == pytest.approx(t.seconds - t.compute)


def test_prefetch_and_kept_units_hide_gathers_and_a_checkpointed_unit_costs_its_calibrated_times() -> None:
    root = _unit("<root>", 2, 4, 1)
    plain = [_unit("a", 10, 20, 3), _unit("b", 10, 20, 3)]
    base = simulate_step(root, plain, COMM, backward_prefetch=None)
    pre = simulate_step(root, plain, COMM, backward_prefetch="pre", forward_prefetch=True)
    kept = simulate_step(root, [_unit("a", 10, 20, 3), _unit("b", 10, 20, 3, reshard_after_forward=False)], COMM)
    # a checkpointed unit's times are as checkpointing runs it (calibrated so): its backward
    # holds the recomputation, nothing is added to them
    ckpt = simulate_step(root, [_unit("a", 12, 35, 3, checkpoint=True), _unit("b", 10, 20, 3)], COMM)
    assert pre.seconds < base.seconds and pre.exposed_comm < base.exposed_comm
    assert kept.seconds <= simulate_step(root, plain, COMM).seconds
    assert ckpt.compute == pytest.approx(simulate_step(root, plain, COMM).compute + (2 + 15) * MS)
    no_shard = simulate_step(root, plain, COMM, no_shard=True)
    assert no_shard.compute == base.compute and no_shard.exposed_comm < base.exposed_comm


def test_a_checkpointed_unit_without_calibrated_times_recomputes_its_forward() -> None:
    from fullshard.plan.steptime import Calibration, _checkpointed

    cal = Calibration(COMM, {"a": BlockTime(0.01, 0.02)}, 0.0, "adamw", {"b": BlockTime(0.5, 0.7)})
    assert _checkpointed(cal, "a") == BlockTime(0.01, 0.03)
    assert _checkpointed(cal, "b") == BlockTime(0.5, 0.7)


def test_the_engines_overhead_is_charged_once_per_unit_and_reported_apart() -> None:
    """Each unit's own engine time falls on the compute clock, half in each pass; a group of
    blocks is one unit and pays one unit's; the step reports it as ``engine``, not compute."""
    import dataclasses

    from fullshard.plan.overhead import Overhead

    root = _unit("<root>", 2, 4, 1)
    plain = [_unit("a", 10, 20, 3), _unit("b", 10, 20, 3)]
    base = simulate_step(root, plain, COMM, backward_prefetch=None)
    costly = [dataclasses.replace(u, overhead=2 * MS) for u in [root, *plain]]
    t = simulate_step(costly[0], costly[1:], COMM, backward_prefetch=None)
    assert t.engine == pytest.approx(6 * MS) and t.compute == pytest.approx(base.compute)
    assert t.seconds >= base.seconds + 3 * MS  # at least the forward halves, on the critical path
    assert merge_costs(costly[1:], 2)[0].overhead == pytest.approx(2 * MS)
    contended = dataclasses.replace(COMM, contended=True, cpu_share=0.5)
    serial = simulate_step(costly[0], costly[1:], contended)
    assert serial.seconds == pytest.approx(serial.compute + 6 * MS + 1.5 * serial.communication)
    kinds = Overhead(no_shard=1.0, full_shard=2.0, shard_grad_op=3.0)
    assert [kinds.per_unit(True, True), kinds.per_unit(False, True), kinds.per_unit(False, False)] == [1.0, 2.0, 3.0]


def test_offloaded_units_copy_before_each_gather_and_after_each_reduction() -> None:
    """CPU offload: the shard's upload precedes each of the unit's gathers (forward and backward)
    and the gradient shard's download follows its reduce-scatter, in the same stream; with
    nothing to overlap (no prefetch) each copy adds its own time to the step."""
    import dataclasses

    comm = dataclasses.replace(COMM, h2d=Link(0.0, 0.5 * MS), d2h=Link(0.0, 0.25 * MS))
    root = _unit("<root>", 2, 4, 1)
    plain = [_unit("a", 10, 20, 4), _unit("b", 10, 20, 4)]
    off = [dataclasses.replace(u, h2d_bytes=2, d2h_bytes=2) for u in plain]
    base = simulate_step(root, plain, comm, backward_prefetch=None)
    t = simulate_step(root, off, comm, backward_prefetch=None)
    # 2 units x (2 uploads of 2 bytes x 0.5 ms + 1 download of 2 bytes x 0.25 ms)
    assert t.seconds == pytest.approx(base.seconds + 2 * (2 * 1.0 + 0.5) * MS)
    assert t.communication == pytest.approx(base.communication + 2 * (2 * 1.0 + 0.5) * MS)
    merged = merge_costs(off, 2)[0]
    assert (merged.h2d_bytes, merged.d2h_bytes) == (4, 4)


def test_contended_cores_overlap_nothing_and_pay_each_collectives_cpu_time() -> None:
    import dataclasses

    root = _unit("<root>", 2, 4, 1)
    plain = [_unit("a", 10, 20, 3), _unit("b", 10, 20, 3)]
    comm = dataclasses.replace(COMM, contended=True, cpu_share=0.5)
    free = simulate_step(root, plain, COMM, optimizer_seconds=MS)
    for prefetch in (None, "pre", "post"):
        t = simulate_step(root, plain, comm, backward_prefetch=prefetch, optimizer_seconds=MS)
        assert t.communication == pytest.approx(free.communication)  # the same collectives
        assert t.seconds == pytest.approx(t.compute + 1.5 * t.communication + MS)
        assert t.exposed_comm == pytest.approx(1.5 * t.communication)
    assert free.seconds < t.seconds


def test_the_overheads_stand_in_has_the_models_units_and_subtracts_its_modelled_collectives() -> None:
    """The stand-in: as many units as asked, each with as many parameters, a root with its own,
    every parameter receiving a gradient; the collectives subtracted are the model's for it."""
    import dataclasses

    from fullshard.plan import overhead

    m = overhead._StandIn(3, 5, 2)
    assert [len(list(u.parameters())) for u in m.units] == [5, 5, 5] and len(list(m.head.parameters())) == 2
    m(torch.ones(4, overhead.WIDTH)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    # NO_SHARD: 4 all-reduces (the root's too) of 5 or 2 parameters of WIDTH floats, no gather
    comm = CommModel(2, "gloo", Link(MS, 0.0), reduce_scatter=Link(2 * MS, 0.0), all_reduce=Link(3 * MS, 0.0))
    assert overhead._collectives(comm, 3, 5, 2, True, (), None) == pytest.approx(4 * 3 * MS)
    # FULL_SHARD: a gather each in forward, again in backward for the 3 resharded units, a reduce-scatter each
    assert overhead._collectives(comm, 3, 5, 2, False, (), None) == pytest.approx((4 + 3) * MS + 4 * 2 * MS)
    kept = tuple(f"units.{i}" for i in range(3))
    assert overhead._collectives(comm, 3, 5, 2, False, kept, None) == pytest.approx(4 * MS + 4 * 2 * MS)
    bytes_cost = dataclasses.replace(comm, all_reduce=Link(0.0, 1.0))
    assert overhead._collectives(bytes_cost, 1, 5, 2, True, (), torch.bfloat16) == pytest.approx((5 + 2) * 64 * 2)
    with pytest.raises(ValueError, match="units=-1"):
        overhead.calibrate_overhead(comm, -1, 5, 2, torch.device("cpu"))


class _Counted(nn.Linear):
    calls: dict[int, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Counted.calls[self.in_features] = _Counted.calls.get(self.in_features, 0) + 1
        return super().forward(x)


def test_time_blocks_runs_a_kind_once_per_unit_of_it_and_times_per_unit() -> None:
    from fullshard.frontend.activation_checkpointing import CheckpointWrapper
    from fullshard.plan.calibrate import time_blocks, time_units

    def make() -> nn.Module:
        return nn.Sequential(_Counted(4, 8), _Counted(8, 8), _Counted(8, 8), _Counted(8, 8))

    def example() -> tuple[torch.Tensor]:
        return (torch.zeros(2, 4),)

    _Counted.calls.clear()
    cpu = torch.device("cpu")
    times = time_blocks(make, example, lambda m, b: m(b[0]).sum(), lambda m: isinstance(m, _Counted), cpu, repeats=1)
    assert set(times) == {"0", "1", "2", "3", "<root>"}
    assert times["1"] == times["2"] == times["3"] != times["0"]  # the 8 -> 8 kind is timed once
    # the meta trace calls each unit once; then 3 repeats (2 warm-ups) x as many copies as units of the kind
    assert _Counted.calls == {8: 3 + 3 * 3, 4: 1 + 3 * 1}
    assert all(times[n].forward > 0 and times[n].backward > 0 for n in "0123")
    _Counted.calls.clear()
    wrapped: list[nn.Module] = []
    real_init = CheckpointWrapper.__init__

    def spy(self: CheckpointWrapper, module: nn.Module, *args: object, **kw: object) -> None:
        wrapped.append(module)
        real_init(self, module, *args, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointWrapper, "__init__", spy)
        both = time_units(make, example, lambda m, b: m(b[0]).sum(), lambda m: isinstance(m, _Counted), cpu, repeats=1)
    # checkpointed, a unit runs once per repeat (one unit's activations at a time) in the
    # frontend's wrapper, its forward again in backward: 2 calls per repeat beside the plain ones
    assert _Counted.calls == {8: 3 + 3 * 3 + 3 * 2, 4: 1 + 3 * 1 + 3 * 2}
    assert [type(m).__name__ for m in wrapped] == ["_Counted", "_Counted"]  # one per kind
    assert set(both.checkpointed) == {"0", "1", "2", "3"} and set(both.blocks) == set(times)
    assert both.checkpointed["1"] == both.checkpointed["3"] and both.checkpointed["1"].backward > 0
    # The first unit fed the raw input (no gradient to compute for it) is another kind than the
    # same layer fed activations: 8 -> 8 units throughout, timed as two kinds.
    _Counted.calls.clear()
    same = time_blocks(
        lambda: nn.Sequential(*(_Counted(8, 8) for _ in range(4))),
        lambda: (torch.zeros(2, 8),),
        lambda m, b: m(b[0]).sum(),
        lambda m: isinstance(m, _Counted),
        cpu,
        repeats=1,
    )
    assert same["1"] == same["2"] == same["3"] != same["0"]
    assert _Counted.calls == {8: 4 + 3 * 3 + 3 * 1}


class _TupleLayer(nn.Linear):
    """Returns (hidden states, None), as transformers' Falcon decoder layer does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class _TupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_TupleLayer(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(x)


def test_time_units_takes_a_units_hidden_states_from_a_tuple_output() -> None:
    """A unit returning a tuple is timed from its first floating-point tensor, and the root's own
    layers are timed with stand-ins returning the same structure (``outputs[0]`` as the model
    reads it); a unit with no tensor in its output is refused, naming it."""
    from fullshard.plan.calibrate import _Stub, hidden_states, time_units

    def example() -> tuple[torch.Tensor]:
        return (torch.zeros(4, 8),)

    def loss(m: nn.Module, b: tuple[torch.Tensor]) -> torch.Tensor:
        return m(b[0]).square().mean()

    t = time_units(_TupleModel, example, loss, lambda m: isinstance(m, _TupleLayer), torch.device("cpu"), repeats=1)
    assert set(t.blocks) == {"layers.0", "layers.1", "<root>"} and set(t.checkpointed) == {"layers.0", "layers.1"}
    assert all(b.forward > 0 and b.backward > 0 for b in [*t.blocks.values(), *t.checkpointed.values()])
    x = torch.ones(4, 8, requires_grad=True)
    out = _Stub((torch.empty(4, 8, device="meta"), None, {"cache": 3}))(x)
    assert out[0].shape == (4, 8) and out[0].requires_grad and out[1:] == (None, {"cache": 3})
    assert hidden_states([None, torch.zeros(2, dtype=torch.long), torch.ones(3)]).shape == (3,)

    class _Ids(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).long()

    with pytest.raises(TypeError, match="unit '0' returns Tensor with no floating-point tensor"):
        time_units(
            lambda: nn.Sequential(_Ids(8, 8)),
            example,
            lambda m, b: m(b[0]).sum().float(),
            lambda m: isinstance(m, _Ids),
            torch.device("cpu"),
            repeats=1,
        )


def test_calibration_and_trace_cast_float_inputs_to_the_compute_dtype() -> None:
    """Under mixed precision the root's floating inputs run in the compute dtype, as FSDP casts
    them (MNIST's images into a bf16 conv raised a dtype error in `--plan auto`); ids stay int64."""
    from fullshard.jobs.models.net import Net
    from fullshard.plan.calibrate import time_blocks
    from fullshard.plan.peak import cast_floats, trace_activations

    def example() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.nll_loss(model(batch[0]).float(), batch[1])

    cast = cast_floats(example(), torch.bfloat16)
    assert (cast[0].dtype, cast[1].dtype) == (torch.bfloat16, torch.long)
    assert cast_floats(example(), None)[0].dtype == torch.float32

    def is_fc1(m: nn.Module) -> bool:
        return isinstance(m, nn.Linear) and m.in_features == 9216

    times = time_blocks(Net, example, loss, is_fc1, torch.device("cpu"), torch.bfloat16, repeats=1)
    assert set(times) == {"fc1", "<root>"}
    assert trace_activations(Net, example, loss, torch.bfloat16)[0] > 0


def test_time_blocks_replays_a_transformers_layers_keyword_inputs() -> None:
    """A Llama decoder layer takes its rotary tables, mask and positions as keyword arguments:
    calibration captures them in the meta forward and replays tensors of their shapes."""
    pytest.importorskip("transformers")
    from fullshard.jobs.train.hf import hf_model
    from fullshard.jobs.train.plan_options import lm_parts
    from fullshard.plan.calibrate import time_blocks

    make, layers = hf_model("llama-tiny")
    example, loss = lm_parts(2, 32)
    times = time_blocks(make, example, loss, lambda m: type(m).__name__ in layers, torch.device("cpu"), repeats=1)
    assert set(times) == {"<root>", *(f"model.model.layers.{i}" for i in range(4))}
    assert all(t.forward > 0 and t.backward > 0 for t in times.values())


class _Permuted(nn.Linear):
    """A unit whose buffer (an index, as BERT's ``position_ids``) must hold what ``__init__`` made."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.register_buffer("order", torch.arange(8).flip(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.order.device.type != "meta" and not torch.equal(self.order, torch.arange(8).flip(0)):
            raise ValueError(f"order holds {self.order.tolist()}")
        return super().forward(x[..., self.order])


class _Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(11, 8), nn.Embedding(40, 8)
        self.register_buffer("position_ids", torch.arange(40)[None], persistent=False)
        self.layers = nn.ModuleList(_Permuted() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.position_ids[:, : x.shape[1]]
        if ids.device.type != "meta" and not torch.equal(ids[0], torch.arange(x.shape[1])):
            raise ValueError(f"position_ids hold {ids.tolist()}")
        h = self.emb(x.long()) + self.pos(ids)
        for layer in self.layers:
            h = layer(h)
        return h


def test_calibration_runs_the_model_with_the_buffers_its_init_made() -> None:
    """Calibration materializes a unit, and the root with stand-ins, from the meta device: its
    buffers held whatever memory was there (``to_empty``), and BERT's ``position_ids`` indexed
    out of bounds (`fullshard plan` crashed). Now they hold what the model's ``__init__`` made,
    without building its parameters (they go to meta as they are registered)."""
    from fullshard.plan.calibrate import time_units
    from fullshard.plan.real_buffers import buffer_values

    def example() -> torch.Tensor:
        return torch.zeros(2, 24)

    times = time_units(_Positions, example, lambda m, x: m(x).sum(), lambda m: isinstance(m, _Permuted), CPU, repeats=1)
    assert set(times.blocks) == {"<root>", "layers.0", "layers.1"}
    values = buffer_values(_Positions)
    assert values is not None and set(values) == {"position_ids", "layers.0.order", "layers.1.order"}
    assert not any(p.device.type != "meta" for p in _built_params(_Positions))


def _built_params(make: object) -> list[torch.Tensor]:
    """The parameters a model built as :func:`buffer_values` builds it holds."""
    from fullshard.plan.real_buffers import _parameters_on_meta

    with _parameters_on_meta():
        return list(make().parameters())  # type: ignore[operator]


def test_grouped_units_gather_once_and_carry_their_members_times() -> None:
    from fullshard.plan.estimate import UnitEstimate, group_units
    from fullshard.plan.simulate import merge_costs

    # Latency-only all-gather (5 ms a call, any size): two units of two blocks save two gathers.
    comm = CommModel(2, "gloo", all_gather=Link(5 * MS, 0.0), reduce_scatter=Link(0.0, 0.0), all_reduce=Link(0.0, 0.0))
    root = _unit("<root>", 2, 4, 1)
    blocks = [_unit(n, 10, 20, 3, checkpoint=n == "b") for n in "abcd"]
    merged = merge_costs(blocks, 2)
    assert [(u.name, u.gather_bytes, u.reduce_bytes, u.checkpoint) for u in merged] == [
        ("a", 6, 6, False),
        ("c", 6, 6, False),
    ]
    assert merged[0].time == BlockTime(20 * MS, 40 * MS)  # b's backward (its recomputation in it) in the group's
    per_block = simulate_step(root, blocks, comm, backward_prefetch=None)
    grouped = simulate_step(root, merged, comm, backward_prefetch=None)
    assert grouped.compute == pytest.approx(per_block.compute)
    assert per_block.seconds - grouped.seconds == pytest.approx(4 * 5 * MS)  # 2 fewer gathers, forward and backward
    assert merge_costs(blocks, 3)[1] is blocks[3] and merge_costs(blocks, 1) == blocks
    with pytest.raises(ValueError, match="size=0"):
        merge_costs(blocks, 0)
    units = [UnitEstimate("<root>", 1, 2, 3, 4, 5)] + [UnitEstimate(n, 10, 20, 30, 40, 50) for n in "abc"]
    assert group_units(units, [("a", "b"), ("c",)]) == [units[0], UnitEstimate("a", 20, 40, 60, 80, 100), units[3]]
    with pytest.raises(KeyError, match="'z'"):
        group_units(units, [("a", "z")])


def test_parse_size() -> None:
    from fullshard.plan.planner import parse_size

    assert parse_size("8GiB") == 8 * 2**30 and parse_size("1.5 mib") == 3 * 2**19 and parse_size("2GB") == 2 * 10**9
    assert parse_size("4096") == 4096
    for bad in ("", "-1GiB", "8 GiBs", "0"):
        with pytest.raises(ValueError, match="KiB, MiB, GiB"):
            parse_size(bad)


@functools.cache
def _fake_calibration(comm_per_byte: float, backend: str = "gloo") -> object:
    """One calibration object per setting (cached: :func:`_scored_once` keys on it)."""
    from fullshard.plan.steptime import Calibration

    blocks = {"<root>": BlockTime(0.004, 0.008)} | {f"blocks.{i}": BlockTime(0.01, 0.02) for i in range(4)}
    comm = CommModel(2, backend, *(Link(1e-4, comm_per_byte) for _ in range(3)))
    if backend == "nccl":  # copies at 1 ns per byte, the optimizer 10x slower on the host
        comm = dataclasses.replace(comm, h2d=Link(1e-5, 1e-9), d2h=Link(1e-5, 1e-9))
    return Calibration(comm, blocks, 1e-9, "adamw", host_optimizer_seconds_per_param=1e-8)


@functools.cache
def _gpt_parts() -> tuple:
    from fullshard.jobs.planning.validate import Config, gpt_parts

    return gpt_parts(Config("gpt-tiny", 2, batch=16))


_SCORED: dict[tuple[int, ...], list] = {}


@pytest.fixture
def _scored_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` scores every candidate of one calibration and model once per test module (a
    meta trace per AC count and sharding is most of its time); each call still chooses under
    its own budget and margin from those scores."""
    from fullshard.plan import planner

    real = planner._score_all

    def scored(*args: object) -> list:
        key = tuple(id(a) for a in args)
        if key not in _SCORED:
            _SCORED[key] = real(*args)
        return _SCORED[key]

    monkeypatch.setattr(planner, "_score_all", scored)


def test_planner_picks_the_fastest_that_fits_and_says_when_nothing_does(_scored_once: None) -> None:
    from fullshard.plan import planner
    from fullshard.plan.margin import MARGIN, MARGIN_FROM
    from fullshard.plan.planner import candidates, needs, plan

    names = [f"blocks.{i}" for i in range(4)]
    # AC on 0..4 blocks x (NO_SHARD + prefetch x FULL_SHARD with 0..all units kept gathered, for
    # units of 1 (5 splits), 2 (3) and 4 blocks (2))
    assert len(candidates(names)) == 5 * (1 + 2 * (5 + 3 + 2))
    assert len(candidates(names, grouping=False)) == 5 * (1 + 2 * 5)
    assert {c.describe() for c in candidates(names) if c.checkpoint == tuple(names[:1]) and not c.forward_prefetch} >= {
        "FULL_SHARD (2 units of 2 blocks), last 1/2 units SHARD_GRAD_OP, AC on 1/4 blocks",
        "SHARD_GRAD_OP (one unit of all 4 blocks), AC on 1/4 blocks",
        "FULL_SHARD, last 1/4 units SHARD_GRAD_OP, AC on 1/4 units",
    }
    make, example, loss, is_unit = _gpt_parts()
    slow_net = plan(_fake_calibration(1e-6), make, example, loss, is_unit, 2**40)
    fastest = min(s.step.seconds for s in slow_net.scored)

    def chosen_by_the_tie_rule(p: planner.Plan) -> bool:
        """``p.best`` is predicted within TIE of the fastest that fits, and has the least
        machinery of those."""
        fit = [s for s in p.scored if p.needs(s) <= p.budget]
        quick = min(s.step.seconds for s in fit)
        ties = [s for s in fit if s.step.seconds <= quick * (1 + planner.TIE)]
        assert p.best is not None and p.best in ties
        return all(planner.machinery(p.best.candidate) <= planner.machinery(s.candidate) for s in ties)

    # A slow network: NO_SHARD (no gathers, one all-reduce per unit) is fastest; checkpointing
    # that hides behind the all-reduces costs no time in the model, so it ties, and the tie goes
    # to the least machinery: no checkpointing.
    assert slow_net.best is not None and slow_net.best.candidate.no_shard and not slow_net.best.candidate.checkpoint
    assert slow_net.best.step.seconds == fastest and chosen_by_the_tie_rule(slow_net)
    # A budget below NO_SHARD's peak but above the smallest: the fastest candidate under it (or
    # one predicted within TIE of it with less machinery).
    grow = 1 + MARGIN  # the share kept free for the estimator's worst measured under-estimate
    budget = math.ceil(grow * (slow_net.best.peak.total + slow_net.smallest.peak.total) / 2)
    tight = plan(_fake_calibration(1e-6), make, example, loss, is_unit, budget)
    assert tight.best is not None and tight.needs(tight.best) <= budget
    assert chosen_by_the_tie_rule(tight)
    assert tight.best.step.seconds >= fastest
    assert MARGIN_FROM.describe() in "\n".join(tight.describe())
    # the least budget anything fits: the candidate needing least, its margin by its strategy
    least = slow_net.needs(slow_net.smallest)
    assert least == min(slow_net.needs(s) for s in slow_net.scored)
    assert least == needs(slow_net.smallest.peak.total, slow_net.margin_of(slow_net.smallest))
    smallest = slow_net.smallest.peak.total
    assert plan(_fake_calibration(1e-6), make, example, loss, is_unit, least).best is not None
    none = plan(_fake_calibration(1e-6), make, example, loss, is_unit, least - 1)
    assert none.best is None
    text = "\n".join(none.describe())
    assert f"needs {least / 2**20:,.1f} MiB (its predicted peak {smallest / 2**20:,.1f} MiB" in text
    assert "Nothing fits" in text and MARGIN_FROM.describe() in text
    assert plan(_fake_calibration(1e-6), make, example, loss, is_unit, smallest, margin=0.0).best is not None
    with pytest.raises(ValueError, match="budget=0"):
        plan(_fake_calibration(1e-6), make, example, loss, is_unit, 0)


def test_planner_offloads_on_cuda_when_nothing_else_fits(_scored_once: None) -> None:
    """On NCCL every sharded candidate also comes with CPU offload: slower (copies, the
    optimizer on the host), so an ample budget gets none, but a budget below every
    non-offloaded peak gets the fastest offloaded candidate. On gloo offload is no candidate."""
    from fullshard.plan.peak import NOT_REPLAYED
    from fullshard.plan.planner import candidates, needs, plan

    names = [f"blocks.{i}" for i in range(4)]
    assert len(candidates(names, offload=True)) == 5 * (1 + 2 * 2 * (5 + 3 + 2))
    make, example, loss, is_unit = _gpt_parts()
    ample = plan(_fake_calibration(1e-9, "nccl"), make, example, loss, is_unit, 2**40)
    assert ample.best is not None and not ample.best.candidate.offload
    offloaded = [s for s in ample.scored if s.candidate.offload]
    assert offloaded and all(s.peak.host > 0 and s.peak.shards == s.peak.optimizer == 0 for s in offloaded)
    on_device = min(s.peak.total for s in ample.scored if not s.candidate.offload)
    below = needs(on_device) - 1  # below what every candidate on the device needs
    tight = plan(_fake_calibration(1e-9, "nccl"), make, example, loss, is_unit, below)
    assert tight.best is not None and tight.best.candidate.offload, tight.describe()
    assert tight.best.candidate.describe().endswith(", CPU offload")
    assert f"; on the host {tight.best.peak.host / 2**20:,.1f}" in tight.describe()[1]
    # NCCL and offload are not replayed as the engine runs: every such prediction says so, and
    # is never below the additive model's
    assert all(s.peak.bound.endswith(NOT_REPLAYED["offload" if s.candidate.offload else "nccl"]) for s in ample.scored)
    assert f"Not exact: {tight.best.peak.bound}." in tight.describe()
    on_gloo = plan(_fake_calibration(1e-6), make, example, loss, is_unit, 2**40)  # the other test's scores
    assert not any(s.candidate.offload or s.peak.bound for s in on_gloo.scored)
    from fullshard.plan.steptime import predict_step  # on a CPU device offload moves nothing

    gloo = _fake_calibration(1e-9)
    assert predict_step(gloo, make, is_unit, offload=True) == predict_step(gloo, make, is_unit)


def test_an_offloaded_plan_passes_the_offload_policy_to_each_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    import fullshard.frontend.fully_shard as front
    from fullshard.plan.planner import Candidate

    calls: list[dict] = []
    monkeypatch.setattr(front, "fully_shard", lambda module, **kw: calls.append(kw) or module)
    make, _, _, _ = _gpt_parts()
    names = tuple(f"blocks.{i}" for i in range(4))
    Candidate(False, (), (), False, names, group=2, offload=True).apply(make())
    assert len(calls) == 3 and all(isinstance(kw["offload_policy"], front.CPUOffloadPolicy) for kw in calls)
    calls.clear()
    Candidate(False, (), (), False, names).apply(make())
    assert len(calls) == 5 and not any("offload_policy" in kw for kw in calls)


def apply_body(rank: int, world: int) -> dict:
    """A plan applied to the tiny GPT trains, with the planned units resharding / checkpointed."""
    from fullshard.frontend.activation_checkpointing import CheckpointWrapper
    from fullshard.plan.planner import Candidate

    make, example, loss, _ = _gpt_parts()
    names = tuple(f"blocks.{i}" for i in range(4))
    batch = tuple(t.random_(0, 10) for t in example())

    def train(cand: Candidate) -> tuple[nn.Module, list[float]]:
        torch.manual_seed(0)
        model = cand.apply(make())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(2):
            value = loss(model, batch)
            value.backward()
            opt.step()
            opt.zero_grad()
            losses.append(value.item())
        return model, losses

    model, losses = train(Candidate(False, names[2:], names[:1], True, names))
    # Units of two blocks (fully_shard of a list), AC on the second block of the first unit, the
    # last unit kept gathered, forward prefetch: the same losses.
    _, grouped = train(Candidate(False, names[2:], names[1:2], True, names, group=2))
    blocks = model.get_submodule("blocks")
    # Built on the meta device, each rank materializes what it holds by the job's init function.
    from fullshard import FSDP
    from fullshard.jobs.models.gpt import init_module
    from fullshard.jobs.models.net import Net

    def is_fsdp(m: nn.Module) -> bool:
        return isinstance(m, FSDP)

    materialized = []
    for cand in (Candidate(True, (), names[:2], False, names), Candidate(False, names[3:], (), True, names)):
        with torch.device("meta"):
            plain = make()
        wrapped = cand.apply(plain, param_init_fn=lambda m: init_module(m, n_layers=4))
        materialized.append(all(not p.is_meta for p in wrapped.parameters()) and bool(loss(wrapped, batch).isfinite()))
    # In bf16 the planned units only, as estimated: no BatchNorm unit of the wrapper's own, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bn_net = Candidate(True, (), (), False, ("0",)).apply(
            nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)), torch.bfloat16
        )
    return {
        "wrapped": [isinstance(b, CheckpointWrapper) for b in blocks],
        "losses": losses,
        "grouped": grouped,
        "no_shard": type(Candidate(True, (), (), False, names).apply(make())).__name__,
        "materialized": materialized,
        # NO_SHARD wraps the planned modules, not every module of their class (fc2 is a Linear too)
        "net_units": [
            n for n, m in Candidate(True, (), (), False, ("fc1",)).apply(Net()).named_modules() if is_fsdp(m)
        ],
        "bn_units": [n for n, m in bn_net.named_modules() if is_fsdp(m)],
    }


@pytest.mark.timeout(200)
def test_a_plan_applies_and_trains() -> None:
    a, b = run_ranks(apply_body, 2, timeout=180)
    assert a["wrapped"] == [True, False, False, False]
    assert a["losses"][1] < a["losses"][0] and a["losses"] == b["losses"]
    assert a["grouped"] == pytest.approx(a["losses"], rel=1e-5) and a["grouped"] == b["grouped"]
    assert a["no_shard"] == "FullyShardedDataParallel"
    assert a["materialized"] == b["materialized"] == [True, True]
    assert a["net_units"] == ["", "_fsdp_wrapped_module.fc1"]
    assert a["bn_units"] == ["", "_fsdp_wrapped_module.0"]


@pytest.mark.timeout(300)
def test_gpt_job_plan_auto(tmp_path: Path) -> None:
    """``--plan auto``: the job plans at start-up, prints the plan, trains as planned; when
    nothing fits, it fails on every rank with the smallest budget that would."""
    check_plan_auto(["gpt"], tmp_path)


@pytest.mark.timeout(200)
def test_plan_cli(capfd: pytest.CaptureFixture[str]) -> None:
    from fullshard.jobs.planning import plan_cli

    base = ["--model", "gpt:tiny", "--batch-size", "2", "--seq-len", "32", "--world-size", "1"]
    assert plan_cli.main([*base, "--memory-budget", "1GiB"]) == 0
    out = capfd.readouterr().out
    assert "Plan for 1,024.0 MiB per rank: **NO_SHARD" in out and "predicted step" in out, out
    assert plan_cli.main([*base, "--memory-budget", "1KiB"]) == 1
    assert "Nothing fits 0.0 MiB per rank" in capfd.readouterr().out
    with pytest.raises(SystemExit):
        plan_cli.main([*base, "--memory-budget", "lots"])
    assert "--memory-budget: 'lots' is not a size" in capfd.readouterr().err
    for budget in (["--memory-budget", "-5MiB"], ["--memory-budget=-5MiB"]):  # argparse said "expected one argument"
        with pytest.raises(SystemExit) as e:
            plan_cli.main([*base, *budget])
        err = capfd.readouterr().err
        assert e.value.code == 2 and "--memory-budget: '-5MiB' is not a size: give a positive" in err, err
    # a worker's failure: its error in one line (the worker's; capfd reads its stderr) and where the
    # tracebacks are, not WorkerFailed's traceback
    real_data = ["--model", "test_plan:refuses_real_data", "--input-shape", "2,8", "--wrap-cls", "_RealDataRefused"]
    assert plan_cli.main([*real_data, "--world-size", "1", "--memory-budget", "1MiB"]) == 2
    err = capfd.readouterr().err
    assert "RuntimeError: this layer refuses real data" in err and "fullshard plan: worker rank 0 failed" in err, err
    assert "Traceback" not in err, err


class _RealDataRefused(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            raise RuntimeError("this layer refuses real data")
        return super().forward(x)


def refuses_real_data() -> nn.Module:
    """A module:factory model that traces on meta and fails in calibration's real forward."""
    return nn.Sequential(_RealDataRefused(8, 8), _RealDataRefused(8, 8))


def slowest_rank_body(rank: int, world: int) -> tuple[dict, float, dict, object]:
    """calibrate() with rank 1's blocks, optimizer and engine overhead made 3x slower than rank 0's."""
    from unittest import mock

    from fullshard.plan import overhead, steptime
    from fullshard.plan.calibrate import UnitTimes

    make, example, loss, is_unit = _gpt_parts()
    real = steptime.time_units, steptime.time_optimizer, overhead._time_steps
    slow = 3.0 if rank == 1 else 1.0
    fake_blocks = {"<root>": BlockTime(0.01, 0.02), "blocks.0": BlockTime(0.1, 0.2)}

    def units(*args: object, **kwargs: object) -> UnitTimes:
        blocks = {n: BlockTime(t.forward * slow, t.backward * slow) for n, t in fake_blocks.items()}
        # a checkpointed block's times, timed apart: here the forward half, the backward twice
        return UnitTimes(blocks, {"blocks.0": BlockTime(0.05 * slow, 0.4 * slow)})

    def steps(wrappings: dict, *args: object) -> list[float]:  # unwrapped, NO_SHARD, FULL_SHARD, SHARD_GRAD_OP
        assert list(wrappings) == ["plain", "no_shard", "full_shard", "shard_grad_op"]
        return [s * slow for s in (0.01, 1.01, 2.01, 3.01)]

    with (
        mock.patch.object(steptime, "time_units", units),
        mock.patch.object(steptime, "time_optimizer", lambda numel, *a: 1e-9 * numel * slow),
        mock.patch.object(overhead, "_time_steps", steps),
    ):
        cal = steptime.calibrate(make, example, loss, is_unit, torch.device("cpu"))
    assert real == (steptime.time_units, steptime.time_optimizer, overhead._time_steps)
    assert 0.0 < cal.comm.cpu_share < 4.0  # gloo's threads spend CPU time on every collective
    checkpointed = {n: (t.forward, t.backward) for n, t in cal.checkpointed.items()}
    times = {n: (t.forward, t.backward) for n, t in cal.blocks.items()}
    return times, cal.optimizer_seconds_per_param, checkpointed, cal.overhead


@pytest.mark.timeout(200)
def test_calibration_keeps_the_slowest_ranks_times() -> None:
    """A step waits for the slowest rank, so every rank's calibration holds its times."""
    a, b = run_ranks(slowest_rank_body, 2, timeout=180)
    assert a == b
    assert a[0] == {"<root>": pytest.approx((0.03, 0.06)), "blocks.0": pytest.approx((0.3, 0.6))}
    assert a[1] == pytest.approx(3e-9)
    assert a[2] == {"blocks.0": pytest.approx((0.15, 1.2))}
    # the stand-in has the calibrated units (one block, as the fake timing says) and the root: 2
    # units; each kind's step less the unwrapped one (3 s, 6 s, 9 s on the slow rank) less a
    # few ms of modelled collectives, per unit
    per_unit = (a[3].no_shard, a[3].full_shard, a[3].shard_grad_op)
    assert per_unit == pytest.approx((3 / 2, 6 / 2, 9 / 2), abs=0.02)
    assert a[3].no_shard < 3 / 2 and a[3].full_shard < 6 / 2  # the collectives' part was taken off


@pytest.mark.timeout(300)
def test_mnist_job_plan_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The MNIST job plans too (its Net, Adadelta and batch): one epoch on a quarter of the
    training images as planned, and at one rank a budget nothing fits fails at start-up."""
    from mnist_idx import train_subset

    data = train_subset(tmp_path / "data", 0.25, 0.2)
    base = [str(BIN / "fullshard"), "train", "mnist", "--epochs", "1", "--data-dir", str(data), "--no-progress"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    metrics = tmp_path / "m.jsonl"
    run = [*base, "--nproc", "2", "--plan", "auto", "--memory-budget", "1GiB", "--metrics-file", str(metrics)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--plan auto: Plan for 1,024.0 MiB per rank: **" in r.stdout, r.stdout[-3000:]
    record = json.loads(metrics.read_text().splitlines()[-1])
    assert record["epoch"] == 1 and record["test_accuracy"] >= 0.6, record  # chance: 0.1
    r = subprocess.run([*base, "--nproc", "1", "--plan", "auto", "--memory-budget", "1MiB"], **_quiet(env))
    assert r.returncode != 0
    assert "--plan auto --memory-budget 1MiB: Nothing fits 1.0 MiB per rank" in r.stderr, r.stderr[-3000:]
    from fullshard.cli import main  # options are checked before any worker starts: in this process

    with pytest.raises(SystemExit) as exit_:
        main([*base[1:], "--memory-budget", "1GiB"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--memory-budget is the budget of --plan auto" in err, err[-3000:]


def _quiet(env: dict[str, str]) -> dict:
    return {"capture_output": True, "text": True, "timeout": 280, "env": env}
