"""The estimator's replay of the engine's buffers (``fullshard.plan.schedule``) against rank 0 of
real steps, to the byte, and its arithmetic on a hand-made trace."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fullshard.engine.layout import DIRECT_GATHER_BYTES
from fullshard.jobs.planning import sweep
from fullshard.jobs.planning.families import Shape
from fullshard.plan.schedule import UnitBuffers, replay, unit_buffers


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Rank 0 of a ``world``-rank gloo group, in this process: torch's fake process group (its
    collectives move nothing), which fullshard treats as gloo; its buffers are the real ones."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fullshard.comm import buffers, collectives

    monkeypatch.setattr(collectives, "backend", lambda group: "gloo")
    buffers.POOL.clear()  # buffers an earlier test left would serve this step unseen

    def start(world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
    buffers.POOL.clear()


GPT = Shape(3, heads=2, kv_heads=2, head_dim=12, ffn=70, vocab=97)
QWEN3 = Shape(2, heads=6, kv_heads=2, head_dim=10, ffn=50, vocab=131)
WIDE_VOCAB = Shape(2, heads=2, kv_heads=2, head_dim=12, ffn=70, vocab=22_000)  # an embedding shard over 1 MiB
WIDE_BLOCKS = Shape(2, heads=4, kv_heads=4, head_dim=24, ffn=600, vocab=22_000)  # blocks of 0.3M parameters too


def _config(
    family: str, shape: Shape | None, strategy: str, ac: str, precision: str, world: int, api: str = "fsdp2"
) -> sweep.Config:
    api = "fsdp1" if strategy == "no_shard" else api  # fully_shard takes no NO_SHARD
    return sweep.Config(0, 0, family, shape or GPT, 3, 24, strategy, ac, precision, world, api)


# One factor each: the full flat gradient at one rank; NO_SHARD's compute-dtype copy; a
# recomputed unit keeping its parameters through its packing while the last reduce-scatter
# is in flight; the pool at 4 ranks; grouped-query attention (qwen3: CPU's flash kernel); a
# root reduced in place.
CASES = [
    ("mnist", None, "full_shard", "none", "fp32", 1, 0, "fsdp2"),
    ("mnist", None, "no_shard", "full", "fp32", 2, 0, "fsdp2"),
    ("gpt", GPT, "full_shard", "none", "fp32", 1, 0, "fsdp2"),
    ("gpt", GPT, "no_shard", "none", "bf16", 2, 0, "fsdp2"),
    ("gpt", GPT, "full_shard", "full", "fp32", 2, 0, "fsdp2"),
    ("gpt", GPT, "full_shard", "full", "bf16", 4, 0, "fsdp2"),
    ("gpt", GPT, "shard_grad_op", "none", "bf16", 4, 0, "fsdp2"),
    ("qwen3", QWEN3, "full_shard", "selective", "fp32", 2, 256, "fsdp2"),
    # the root's size is its own (its embedding gathered on its own): its gradient shards stay
    # in its packed gradient at 2 ranks
    ("gpt", WIDE_VOCAB, "full_shard", "none", "fp32", 2, 0, "fsdp2"),
    # the peak in the root's backward, after the pool freed the blocks' buffers (only the root
    # left to run backward): without that in the replay the estimate is 839,800 bytes (a block's
    # full buffer) too high. A parameter alone between two gathered on their own (the final
    # norm's weight, between the embedding and the head) is gathered in place, through no
    # scratch: the estimate was 376 bytes over while it counted one (88 in the case above, 192
    # and 516 in the wrapper's below)
    ("gpt", WIDE_BLOCKS, "full_shard", "none", "fp32", 2, 0, "fsdp2"),
    # the wrapper keeps its last unit of forward gathered into backward (hooks.keeps_last_gathered),
    # with and without its recomputation
    ("gpt", GPT, "full_shard", "none", "fp32", 2, 0, "fsdp1"),
    ("gpt", WIDE_BLOCKS, "full_shard", "full", "bf16", 2, 0, "fsdp1"),
    # fc1's weight (128 rows) padded at 3 ranks: its gradient was padded in a copy of its own
    # before packing, 4.6 MB (17%) above the estimate; now packed in place. fc1's bias, gathered
    # on its own after the weight, needs no scratch (the estimate was 516 bytes over here).
    ("mnist", None, "full_shard", "none", "fp32", 3, 0, "fsdp1"),
    # mixed precision casts the root's float inputs (the images): the caller's float32 batch
    # stays alive beside the bf16 copy (the trace held only the copy: 9,408 bytes under)
    ("mnist", None, "shard_grad_op", "none", "bf16", 2, 0, "fsdp1"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "shape", "strategy", "ac", "precision", "world", "slack", "api"), CASES)
def test_the_estimate_is_rank_zeros_third_step(
    fake_world,
    family: str,
    shape: Shape | None,
    strategy: str,
    ac: str,
    precision: str,
    world: int,
    slack: int,
    api: str,
) -> None:
    """The predicted peak equals rank 0's measured peak (LiveTensorBytes, third step): to a few bytes
    where the traced activations are exact (the GPT, the MNIST Net), within ``slack`` bytes where
    transformers' own trace is (a few bytes of its mask code); the moment matches."""
    from fullshard.jobs.planning.sweep_bench import measure_rank, predict

    if family not in ("mnist", "gpt"):
        pytest.importorskip("transformers")
    c = _config(family, shape, strategy, ac, precision, world, api)
    estimate = predict(c)
    fake_world(world)
    measured, moment, _ = measure_rank(c, torch.device("cpu"))
    scalars = 64  # a few 0-dim tensors (4 x world bytes measured) the trace does not see
    assert abs(estimate.total - measured) <= slack + scalars, (c.describe(), estimate, measured, moment)
    assert estimate.moment == moment, (estimate.moment, moment)


# Four blocks as wide as the sweep's 8-block GPT that was 260,608 bytes under in bf16.
WIDE_D = Shape(4, heads=8, kv_heads=8, head_dim=64, ffn=2048, vocab=1000, tied=True)


@pytest.mark.timeout(120)
def test_a_units_gradients_arrive_when_autograd_reaches_its_full_parameters_node(fake_world) -> None:
    """A unit's gradients reach the engine together, when autograd runs the node that made its
    full parameters (in its pre-forward: a low sequence number), after the rest of the unit's
    ready backward. In bf16 the first block's first RMSNorm still holds its float32 input at
    the last weight gradient, and frees it before that node runs. The trace took the gradients
    as each landed: 260,608 bytes under (that 2 x 64 x 512 float32 tensor, less 1,536 bytes of
    the norm's own backward)."""
    from fullshard.jobs.planning.sweep_bench import measure_rank, predict

    c = sweep.Config(0, 0, "gpt", WIDE_D, 2, 64, "full_shard", "none", "bf16", 2, "fsdp1")
    estimate = predict(c)
    fake_world(2)
    measured, moment, _ = measure_rank(c, torch.device("cpu"))
    assert 0 <= estimate.total - measured <= 64, (estimate, measured, moment)
    assert estimate.moment == moment == "backward of blocks.0", (estimate.moment, moment)


def test_gather_pieces_split_at_large_parameters_on_gloo_only() -> None:
    from fullshard.engine.layout import gather_pieces

    big, small = DIRECT_GATHER_BYTES, DIRECT_GATHER_BYTES - 1
    sizes = [small, big, small, small, big, small, big, big]
    assert gather_pieces(sizes, True) == [[0], [1], [2, 3], [4], [5], [6], [7]]
    assert gather_pieces(sizes, False) == [list(range(8))]  # NCCL: one piece
    assert gather_pieces([small, small], True) == [[0, 1]]
    assert gather_pieces([], True) == [] and gather_pieces([], False) == []


class _Params(torch.nn.Module):
    """One unit's parameters, as drawn (the root owns them all)."""

    def __init__(self, shapes: list[tuple[int, ...]], frozen: list[bool]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(shape), requires_grad=not f) for shape, f in zip(shapes, frozen)
        )


def test_the_replays_buffers_are_the_engines_on_drawn_units(fake_world) -> None:  # noqa: ANN001
    """The replay's sizes of a unit's buffers (``unit_buffers``: full, scratch, packed) are the
    ones the engine takes from the pool (``UnitLayout.pooled_sizes``), on 30 drawn units at 2, 3
    and 4 ranks: 1-6 parameters, some large enough to be gathered on their own (1 MiB shards),
    some frozen, so runs of one parameter between them (gathered in place) come up too."""
    import copy

    import torch.distributed as dist

    from fullshard import FSDP

    g = torch.Generator().manual_seed(46)

    def draw(hi: int) -> int:
        return int(torch.randint(1, hi + 1, (1,), generator=g))

    seen_single_runs = 0
    for world in (2, 3, 4):
        fake_world(world)
        for _ in range(10):
            shapes: list[tuple[int, ...]] = []
            for _ in range(draw(6)):
                kind = draw(3)  # 1: a large weight (its shard up to 3 MiB), 2: a small one, 3: a vector
                big, small = (draw(700) * world, 1100), (draw(300), draw(40))
                shapes.append(big if kind == 1 else small if kind == 2 else (draw(90),))
            frozen = [draw(4) == 1 for _ in shapes]
            model = _Params(shapes, frozen)
            (predicted,) = unit_buffers(copy.deepcopy(model), lambda m: False, world)
            unit = FSDP(model).unit
            want = [(predicted.full, torch.float32), (predicted.packed, torch.float32)]
            want += [(n, torch.float32) for n in predicted.scratch]
            assert unit.pooled_sizes() == want, (world, shapes, frozen, unit.pooled_sizes(), predicted)
            seen_single_runs += sum(
                len(group) == 1 and group[0].spec.padded_shard_numel * 4 < DIRECT_GATHER_BYTES
                for group, _, _ in unit._pieces
            )
        dist.destroy_process_group()
    assert seen_single_runs > 0  # the draws reach the case this test is for


def _unit(name: str, numel: int, world: int, compute: int = 4, param: int = 4) -> UnitBuffers:
    shard = -(-numel // world)
    full = 0 if world == 1 and compute == param else world * shard
    scratch = (world * shard,) if world > 1 else ()
    return UnitBuffers(name, full, scratch, world * shard, shard, compute, compute, param)


def test_one_rank_packs_a_units_gradient_beside_its_per_parameter_gradients() -> None:
    """One rank, float32: nothing gathered (the full buffer is the shard), but packing copies a
    unit's per-parameter gradients into one flat buffer, which then is the gradient; at that
    moment both copies exist. Unit "a" (1000 elements) gets its gradients, then "b" (10)."""
    units = [_unit("<root>", 0, 1), _unit("a", 1000, 1), _unit("b", 10, 1)]
    totals = [0, 4000, 40]
    act = 500  # activations alive at every sample, for simplicity
    samples = [
        (act, (0, 0, 0), False, "a"),
        (act, (0, 0, 0), False, "b"),
        (act + 40, (0, 0, 40), True, "b"),
        (act + 4040, (0, 4000, 40), True, "a"),
        (act + 4040, (0, 4000, 40), True, "<root>"),
    ]
    peak = replay(units, samples, totals, 0, 1, state=7)
    # at "a"'s packing: its 4000 bytes of per-parameter gradients, the 4000-byte packed copy,
    # "b"'s packed gradient (40), the activations and the state
    assert peak.total == 7 + 4000 + 4000 + 40 + act, peak
    assert (peak.phase, peak.unit) == ("backward", "a")


def test_no_shard_in_bf16_gathers_a_compute_copy_of_every_unit() -> None:
    """NO_SHARD keeps each unit whole, but under bf16 mixed precision each is gathered into a
    bf16 copy (2 bytes per element) that stays from its forward to its packing (no reshard
    after forward); the packed bf16 gradient is cast into a float32 one."""
    units = [_unit("<root>", 0, 1, 2, 4), _unit("a", 1000, 1, 2, 4), _unit("b", 1000, 1, 2, 4)]
    big = 10**6  # the loss's backward holds the most activations: the peak comes there
    samples = [
        (0, (0, 0, 0), False, "a"),
        (0, (0, 0, 0), False, "b"),
        (big, (0, 0, 0), True, "<root>"),
        (2000, (0, 0, 2000), True, "b"),
        (4000, (0, 2000, 2000), True, "a"),
    ]
    peak = replay(units, samples, [0, 2000, 2000], 0, 2, sharding_strategy="no_shard", state=7)
    assert (peak.phase, peak.unit, peak.activations) == ("backward", "<root>", big), peak
    assert peak.gathered == 2 * 2000 and peak.grads == 0 and peak.total == 7 + 4000 + big, peak
    # without it, the end of backward: both float32 gradients (2 x 4000) and a's packed bf16 one
    samples[2] = (0, (0, 0, 0), True, "<root>")
    peak = replay(units, samples, [0, 2000, 2000], 0, 2, sharding_strategy="no_shard")
    assert (peak.grads, peak.grad_buffer, peak.gathered, peak.total) == (8000, 2000, 0, 10000), peak


# The planner's settings the sweep's configurations never take: units of several blocks, some
# units kept gathered after forward, forward prefetch (each with AC, bf16 or 4 ranks too).
BLOCKS = ("blocks.0", "blocks.1", "blocks.2")
PLANNED = [
    # (keep_gathered, checkpoint, forward_prefetch, group, bf16, world)
    ((), (), False, 2, False, 2),
    (BLOCKS[2:], BLOCKS[:1], False, 2, True, 2),
    (BLOCKS[2:], (), True, 1, False, 4),
    ((), BLOCKS[:2], True, 2, True, 2),
    ((), BLOCKS[:1], False, 3, False, 2),
]


def _measure_candidate(candidate, parts, dtype: torch.dtype | None) -> tuple[int, str]:  # noqa: ANN001
    """Rank 0's third step under ``candidate`` (peak live tensor bytes, moment), as the sweep measures."""
    from fullshard.plan.running_unit import RunningUnit
    from fullshard.plan.tracker import LiveTensorBytes

    make, example, loss_fn, is_unit = parts
    running: list[RunningUnit] = []
    with LiveTensorBytes(label=lambda: running[0].moment if running else "building") as live:
        torch.manual_seed(0)
        model = make()
        running.append(RunningUnit(model, is_unit))
        model = candidate.apply(model, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for _ in range(3):
            x, y = example()
            batch = (x.random_(0, GPT.vocab), y.random_(0, GPT.vocab))
            live.reset_peak()
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return live.peak, str(live.peak_label)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kept", "ac", "prefetch", "group", "bf16", "world"), PLANNED)
def test_a_planned_candidates_estimate_is_rank_zeros_third_step(
    fake_world, kept: tuple, ac: tuple, prefetch: bool, group: int, bf16: bool, world: int
) -> None:
    """What the planner predicts for a candidate (:func:`~fullshard.plan.planner.predict_peak`)
    equals rank 0's measured peak with the candidate applied, to a few bytes; the moment matches."""
    from fullshard.jobs.planning import families
    from fullshard.plan.planner import Candidate, predict_peak

    parts = families.parts("gpt", GPT, 3, 24)
    dtype = torch.bfloat16 if bf16 else None
    candidate = Candidate(False, kept, ac, prefetch, BLOCKS, group)
    estimate = predict_peak(candidate, *parts, world, param_dtype=dtype)
    fake_world(world)
    measured, moment = _measure_candidate(candidate, parts, dtype)
    assert not estimate.bound
    assert abs(estimate.total - measured) <= 64, (candidate.describe(), estimate, measured, moment)
    assert estimate.moment == moment, (estimate.moment, moment)


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _FrozenNet(torch.nn.Module):
    """An input layer, three blocks (the units) and a head; ``frozen`` blocks, and the input
    layer with ``frozen_input``, have ``requires_grad=False``."""

    def __init__(self, frozen: tuple[int, ...], frozen_input: bool, d: int = 128) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(16, d), torch.nn.Linear(d, 10)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(3))
        for i in frozen:
            self.blocks[i].requires_grad_(False)
        self.inp.requires_grad_(not frozen_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("frozen", "frozen_input"),
    [
        # blocks.0's output needs no gradient: it never runs backward, but blocks.1's pre-backward
        # prefetches it, and it stays gathered (its all-gather scratch too) to the end of backward
        ((0,), True),
        # blocks.0 and blocks.1 run backward with no gradient of their own: no post-backward
        # reshards them; they stay gathered to the end of backward, and finish no reduction
        ((0, 1), False),
    ],
)
def test_units_with_every_parameter_frozen_in_the_wrapper_in_bf16(
    fake_world, frozen: tuple[int, ...], frozen_input: bool
) -> None:
    """A unit whose parameters are all frozen has no gradient hook, so the engine never runs its
    post-backward: the replay neither reshards it nor finishes the last reduction there. Rank 0
    of 2, the FSDP1 wrapper, bf16: the estimate was 0.92 MiB (d=256) under the measured peak."""
    import functools
    import types

    import torch.nn.functional as F

    from fullshard.frontend.wrap import lambda_auto_wrap_policy
    from fullshard.jobs.train import fsdp_options
    from fullshard.plan.peak import estimate_peak
    from fullshard.plan.tracker import LiveTensorBytes

    def make() -> torch.nn.Module:
        return _FrozenNet(frozen, frozen_input)

    def example() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(32, 16), torch.zeros(32, dtype=torch.long)

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]).float(), batch[1])

    def is_unit(m: torch.nn.Module) -> bool:
        return isinstance(m, _Block)

    estimate = estimate_peak(make, example, loss_fn, is_unit, 2, param_dtype=torch.bfloat16, front_end="wrapper")
    fake_world(2)
    opts = types.SimpleNamespace(
        sharding_strategy="full_shard", mixed_precision="bf16", cpu_offload=False, backward_prefetch="pre",
        forward_prefetch=False, api="fsdp1",
    )  # fmt: skip
    with LiveTensorBytes() as live:
        torch.manual_seed(0)
        model = fsdp_options.shard_model(make(), opts, functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        for _ in range(3):
            x, y = example()
            live.reset_peak()
            loss_fn(model, (x.normal_(), y.random_(0, 10))).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert 0 <= estimate.total - live.peak <= 2048, (estimate, live.peak)


class _BatchNormNet(torch.nn.Module):
    """Three conv blocks with BatchNorm2d (units of their own in float32 under the wrapper's
    default mixed precision) and a head."""

    def __init__(self) -> None:
        super().__init__()
        from models import ConvBlock

        self.blocks = torch.nn.Sequential(ConvBlock(3, 16), ConvBlock(16, 16), ConvBlock(16, 16))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


@pytest.mark.parametrize("full_precision", [None, ()], ids=["batchnorm_units", "none"])
def test_batch_norm_kept_in_float32_by_the_wrapper_is_estimated(fake_world, full_precision) -> None:
    """The FSDP1 wrapper's default ``MixedPrecision._module_classes_to_ignore`` makes each
    BatchNorm a float32 unit whose input is cast up (saved for backward in float32): the
    estimate, which mirrors it by default, was 48% under the measured peak before it did (20.9
    against 30.9 MiB on a larger net of this kind). Rank 0 of 2, bf16, to 4 KiB above; with
    ``()`` (no such units) as the wrapper runs that."""
    import functools

    from models import ConvBlock

    from fullshard import FSDP, MixedPrecision
    from fullshard.frontend.wrap import lambda_auto_wrap_policy
    from fullshard.plan.peak import estimate_peak
    from fullshard.plan.tracker import LiveTensorBytes

    def example() -> torch.Tensor:
        return torch.zeros(8, 3, 12, 12)

    def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).float().pow(2).mean()

    def is_unit(m: torch.nn.Module) -> bool:
        return isinstance(m, ConvBlock)

    kwargs = {} if full_precision is None else {"_module_classes_to_ignore": full_precision}
    estimate = estimate_peak(
        _BatchNormNet, example, loss_fn, is_unit, 2, param_dtype=torch.bfloat16, full_precision=full_precision
    )
    fake_world(2)
    with LiveTensorBytes() as live, pytest.warns() if full_precision is None else contextlib.nullcontext():
        torch.manual_seed(0)
        bf16 = torch.bfloat16
        model = FSDP(
            _BatchNormNet(),
            auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit),
            mixed_precision=MixedPrecision(bf16, bf16, bf16, **kwargs),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            live.reset_peak()
            loss_fn(model, example().normal_()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    # With () every BatchNorm runs in bf16 inside its block's unit; the estimate is then 3.9%
    # over (14 KiB here: the meta trace's bf16 batch norm keeps more than CPU's kernel does).
    over = 4096 if full_precision is None else 0.05 * live.peak
    assert 0 <= estimate.total - live.peak <= over, (estimate, live.peak)
