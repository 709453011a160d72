"""CPU buffer reuse across steps: a unit's full parameters, its packed gradients and its gradient
shards come from the memory the last step gave back (no fresh pages to fault in), never from
memory a user still holds; and a unit's full parameters are freed before its gradients are
packed, unless something may still read them (a unit called twice, frozen parameters)."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import Block, batch, local, make_stack
from torch import nn


def _fsdp(module: nn.Module) -> nn.Module:
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    return FSDP(module, auto_wrap_policy=ModuleWrapPolicy({Block}))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    x, y = batch(step, 12)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()
    opt.step()


def reuse_body(rank: int, world: int) -> dict:
    from fullshard import FSDP
    from fullshard.comm import buffers

    model = _fsdp(make_stack())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    units = [m.unit for m in FSDP.fsdp_modules(model)]
    _train_step(model, opt, 0, rank, world)
    # Kept from step 1: the pool's buffers, and the packed gradients that hold the gradient
    # shards of units whose size is their own (they go back to the pool after zero_grad).
    pooled = {t.data_ptr() for t in buffers.POOL.buffers()}
    pooled |= {u.grads.holding_packed.data_ptr() for u in units if u.grads.holding_packed is not None}
    grad_ptrs = [u.local_view(u.trainable[0], u.grads.last_output).data_ptr() for u in units]
    # Where step 2's gradient shards may live: the gradient buffers or the memory pooled above.
    grad_memory = pooled | {u.grads.last_output.untyped_storage().data_ptr() for u in units}

    # Step 2: every unit's full parameters live in memory the pool kept from step 1.
    during: list[int] = []
    by_name = {u.name: u for u in units}
    hooks = [
        b.lin.register_forward_hook(
            lambda m, i, o, u=by_name[f"blocks.{k}"]: during.append(u.full_data.untyped_storage().data_ptr())
        )
        for k, b in enumerate(model.module.blocks)
    ]
    _train_step(model, opt, 1, rank, world)
    for h in hooks:
        h.remove()
    reused_grads = [
        sp.shard.grad.data_ptr() == p
        if u.grads.holding_packed is None
        else sp.shard.grad.untyped_storage().data_ptr() in grad_memory
        for u, p in zip(units, grad_ptrs)
        for sp in u.trainable[:1]
    ]

    # Step 3 while the user holds step 2's gradients: they must stay as they were.
    held = [p.grad for p in model.parameters()]
    kept = [g.clone() for g in held]
    _train_step(model, opt, 2, rank, world)
    untouched = all(torch.equal(a, b) for a, b in zip(held, kept))
    aliased = any(p.grad.data_ptr() == g.data_ptr() for p, g in zip(model.parameters(), held) if g.numel())
    return {
        "pooled": len(pooled),
        "from_pool": [ptr in pooled for ptr in during],
        "reused_grads": reused_grads,
        "untouched": untouched,
        "aliased": aliased,
        "idle": all(u.shard_state.name == "SHARDED" for u in units),
    }


def test_buffers_come_back_from_the_last_step_and_never_alias_held_gradients() -> None:
    for r in run_ranks(reuse_body, 2):
        assert r["pooled"] > 0
        # The stack's blocks are each of their own size. Once blocks.0 (first in forward, last in
        # backward) has resharded in backward, only the root is left, gathered: the pool frees the
        # blocks' buffers (backward_buffers.drop_done_with), idle through the root's backward. Then
        # blocks.0's reduction finishes and gives its packed gradient back: step 2's blocks.0
        # gathers into it, the others into new buffers.
        assert r["from_pool"] == [True, False, False, False], r
        assert all(r["reused_grads"]), r["reused_grads"]
        assert r["untouched"] and not r["aliased"], r
        assert r["idle"]


def world_one_body(rank: int, world: int) -> dict:
    from fullshard.comm import buffers
    from fullshard.engine.layout import UnitLayout

    model = _fsdp(make_stack())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt, 0, rank, world)
    calls = [0]
    sizes = UnitLayout.pooled_sizes

    def counted(self: UnitLayout) -> list[tuple[int, torch.dtype]]:
        calls[0] += 1
        return sizes(self)

    UnitLayout.pooled_sizes = counted  # type: ignore[method-assign]
    try:
        _train_step(model, opt, 1, rank, world)
    finally:
        UnitLayout.pooled_sizes = sizes  # type: ignore[method-assign]
    return {"held": buffers.POOL.held_sizes(), "calls": calls[0]}


def test_world_size_one_backward_skips_the_pool_bookkeeping() -> None:
    # At world size 1 nothing is gathered and the pool stays empty: each unit's post-backward
    # must not walk every unit's buffer sizes (backward_buffers.drop_done_with), a cost that grew
    # with the square of the units (about 3% of a 32-block step).
    (r,) = run_ranks(world_one_body, 1)
    assert r == {"held": set(), "calls": 0}, r


def cast_gather_body(rank: int, world: int) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from fullshard import FSDP, MixedPrecision

    ref = make_stack()
    model = FSDP(copy.deepcopy(ref), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    unit = model.unit
    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        unit.unshard(async_op=True)
    unit.wait_for_unshard()
    full = [t.detach().clone() for t in unit.full_params(tracked=False)]
    unit.reshard()
    want = [p.detach().to(torch.bfloat16) for p in ref.parameters()]
    return {
        "conversions": sum(op.startswith("aten._to_copy") for op in ops),
        "equal": len(full) == len(want) and all(torch.equal(a, b) for a, b in zip(full, want)),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_mixed_precision_gather_casts_into_its_output(world: int) -> None:
    # The shards (float32) are cast into their own slot of the gathered bfloat16 buffer and sent
    # from there: no converted copy of the shards beside it, which lived as long as a prefetched
    # gather was in flight (on real gloo one layer's shard over the estimate). Same bits.
    for r in run_ranks(cast_gather_body, world):
        assert r == {"conversions": 0, "equal": True}, r


class _Twice(nn.Module):
    """One Block applied twice: its unit gets two split nodes in one backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, 13)
        self.block = Block(13, 13)
        self.head = nn.Linear(13, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(self.stem(x))))


def _with_frozen() -> nn.Module:
    model = make_stack()
    model.blocks[1].norm.weight.requires_grad_(False)  # a frozen parameter inside a unit
    return model


def pack_order_body(rank: int, world: int, build: str) -> dict:
    from fullshard.engine.unit import Unit

    ref = _Twice() if build == "twice" else _with_frozen()
    model = _fsdp(copy.deepcopy(ref))
    full_at_pack: list[tuple[str, int]] = []
    original = Unit.pack_grads

    def spy(self: Unit, grads):  # type: ignore[no-untyped-def]
        full_at_pack.append((self.name, self.full_data.untyped_storage().nbytes()))
        return original(self, grads)

    Unit.pack_grads = spy  # type: ignore[method-assign]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(3):
        _train_step(model, opt, step, rank, world)
        _train_step(ref, ref_opt, step, 0, 1)
    Unit.pack_grads = original  # type: ignore[method-assign]
    from fullshard import FSDP

    with FSDP.summon_full_params(model):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"full_at_pack": full_at_pack, "diff": diff}


def test_full_parameters_are_freed_before_packing_only_when_nothing_reads_them_later() -> None:
    for r in run_ranks(pack_order_body, 2, "twice"):
        assert r["diff"] < 1e-5, r["diff"]
        block = [n for name, n in r["full_at_pack"] if name == "block"]
        # Per step: the first of the two split nodes packs with the parameters still gathered
        # (the second use's backward still reads them), the last one after they were freed.
        assert block[:2] and block[0] > 0 and block[1] == 0, block
        assert all(n == 0 for name, n in r["full_at_pack"] if name == "<root>")
    for r in run_ranks(pack_order_body, 2, "frozen"):
        assert r["diff"] < 1e-5, r["diff"]
        sizes = dict(r["full_at_pack"][:5])
        assert sizes["blocks.1"] > 0, sizes  # shares its buffer with a frozen parameter
        assert sizes["blocks.0"] == 0 and sizes["blocks.2"] == 0, sizes


def two_rank_reduce_scatter_body(rank: int, world: int) -> dict:
    from fullshard.comm import buffers, collectives

    group = collectives.default_group()
    inputs = [torch.randn(2 * 1000, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    buffers.POOL.clear()
    out = torch.empty(1000)
    handle = collectives.reduce_scatter(out, inputs[rank], group, divide_by=3.0, async_op=True)
    assert handle is not None
    pool_during = buffers.POOL.nbytes
    handle.wait()
    chunk = slice(rank * 1000, (rank + 1) * 1000)
    # The previous order of the sum (own chunk + the one received), bit for bit.
    expect = torch.add(inputs[rank][chunk], inputs[1 - rank][chunk]).div_(3.0)
    result = {"pool": (pool_during, buffers.POOL.nbytes), "equal": torch.equal(out, expect)}
    # In place: the output is this rank's own chunk of the input (sizes below and above the
    # piece count, uneven pieces, bfloat16), synchronous and not.
    in_place = []
    for numel, dtype, async_op in ((3, torch.float32, True), (1001, torch.float32, False), (77, torch.bfloat16, True)):
        both = [torch.randn(2 * numel, generator=torch.Generator().manual_seed(10 + r)).to(dtype) for r in range(world)]
        mine = both[rank].clone()
        own = mine.view(2, -1)[rank]
        h = collectives.reduce_scatter(own, mine, group, divide_by=2.0, async_op=async_op)
        if h is not None:
            h.wait()
        part = slice(rank * numel, (rank + 1) * numel)
        in_place.append(torch.equal(own, torch.add(both[rank][part], both[1 - rank][part]).div_(2.0)))
    result["in_place"] = in_place
    result["pool_kept"] = sorted(t.numel() for t in buffers.POOL.buffers())  # the staging buffers, back
    return result


def test_two_rank_reduce_scatter_receives_into_its_output() -> None:
    """At two ranks gloo's reduce-scatter needs no receive buffer (issue 33: 149 MiB per rank of
    pooled receive buffers on the 167M GPT): the other rank's chunk lands in the output and the
    own chunk is added there, the same bits as the own chunk plus the received one. With the own
    chunk of the input as the output, the sum is made in place (pieces received into the places
    of pieces already sent, the first through a pooled staging buffer), the same bits again."""
    for r in run_ranks(two_rank_reduce_scatter_body, 2):
        assert r["pool"] == (0, 0), r
        assert r["equal"], r
        assert r["in_place"] == [True, True, True], r
        assert r["pool_kept"] == [1, 10, 126], r  # the first piece of 3, of 77 and of 1001 elements


def test_a_buffer_lent_to_a_reduction_counts_against_the_pools_cap() -> None:
    """The pool keeps at most ``per_size`` buffers of a size, counting one lent to a reduction in
    flight: a surplus is freed when it is given back, before the lent one returns (issue 33)."""
    from fullshard.comm.buffers import BufferPool

    pool = BufferPool(per_size=2)
    a, b, packed = (pool.acquire(100, torch.float32, torch.device("cpu")) for _ in range(3))
    pool.lend(packed)
    pool.release(a)
    pool.release(b)  # two kept plus one lent would be three: b is freed now
    assert [t is a for t in pool.buffers()] == [True]
    pool.release(packed, lent=True)
    assert len(pool.buffers()) == 2 and pool.buffers()[1] is packed
    pool.lend(pool.acquire(100, torch.float32, torch.device("cpu"))[:50])  # a view is never kept: not counted
    pool.release(b)
    assert len(pool.buffers()) == 2
    pool.clear()
    assert pool.nbytes == 0


def in_place_body(rank: int, world: int) -> dict:
    from fullshard import FSDP, model_state_bytes

    torch.manual_seed(0)
    # The root's wide layer is gathered on its own (a padded shard over 1 MiB), its other
    # parameters through a scratch buffer of another size; the blocks are all small.
    model = _fsdp(
        nn.Sequential(Block(6, 13), Block(13, 13), Block(13, 13), nn.Linear(13, 41_000), nn.Linear(41_000, 3))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    units = [m.unit for m in FSDP.fsdp_modules(model)]
    holding = []
    for step in range(2):
        _train_step(model, opt, step, rank, world)
        ptrs = {}  # by name: given at the first forward
        for u in units:
            ptrs[u.name] = None if u.grads.holding_packed is None else u.grads.holding_packed.data_ptr()
        holding.append(ptrs)
    grads = model_state_bytes(model)["grads"]
    return {"holding": holding, "grads": grads, "expect": sum(4 * u.grad_numel for u in units)}


def test_gradient_shards_of_a_unit_of_its_own_size_stay_in_its_packed_gradient() -> None:
    """A unit whose buffers no other unit's match in size keeps its gradient shards in its own
    chunk of the packed gradient (issue 33: 125 MiB less per rank on the 167M GPT, whose root is
    such a unit), and that memory serves its next step once zero_grad dropped them; units of a
    shared size (two equal blocks, a block and its own all-gather scratch) keep theirs in a
    buffer of their own. The shards' bytes count S_t, not the whole packed buffer."""
    for r in run_ranks(in_place_body, 2):
        first, second = r["holding"]
        # 1 and 2 share their size; 0's scratch buffer (one run of small parameters) has its size
        assert first["0"] is None and first["1"] is None and first["2"] is None, first
        assert first["<root>"] is not None, first
        assert second == first, (first, second)
        assert r["grads"] == r["expect"], r


def test_a_padded_parameters_gradient_is_packed_without_a_padded_copy() -> None:
    """pack_rows_into writes rank r's rows, then zeros, into strided columns of the pack: the
    layout of padding each gradient and concatenating, for rows that fill no rank, one rank in
    part, or leave ranks empty; and allocates nothing of the gradient's size."""
    from fullshard.engine.grad_pack import pack_rows_into
    from fullshard.engine.sharded_param import ShardSpec
    from fullshard.plan.tracker import LiveTensorBytes

    for shape, n in [((10, 3), 4), ((2, 5), 4), ((12, 2), 4), ((7,), 3), ((129, 64), 3), ((0, 4), 2)]:
        spec = ShardSpec(torch.Size(shape), n, 0)
        grad = torch.randn(shape)
        rows = grad.reshape(spec.rows, spec.row_numel)
        padded = nn.functional.pad(rows, (0, 0, 0, n * spec.chunk_rows - spec.rows))
        expected = torch.cat([torch.ones(n, 2), padded.reshape(n, -1), torch.ones(n, 1)], dim=1)
        pack = torch.full((n, spec.padded_shard_numel + 3), float("nan"))
        pack[:, :2] = 1
        pack[:, -1] = 1
        with LiveTensorBytes() as live:
            live.adopt([pack, grad])
            held = live.measure()
            live.reset_peak()
            pack_rows_into(pack[:, 2:-1], grad, spec)
            pack_rows_into(pack[:, 2:2], None, ShardSpec(torch.Size((0,)), n, 0))
        assert live.peak == held, (shape, n, live.peak - held)
        assert torch.equal(pack, expected), (shape, n)
        pack_rows_into(pack[:, 2:-1], None, spec)
        assert not pack[:, 2:-1].any()


def test_the_one_concatenation_pack_equals_the_per_parameter_pack() -> None:
    """pack_into's single torch.cat (no parameter padded, no gradient missing, one dtype) writes
    the same bits as pack_rows_into parameter by parameter; a padded, missing or other-dtype
    gradient takes the per-parameter copies for the whole pack, with the same result."""
    from fullshard.engine.grad_pack import pack_into, pack_rows_into
    from fullshard.engine.sharded_param import ShardSpec

    cases = [
        ([(8, 3), (4,), (12, 2, 2)], 4, None),  # unpadded: the one concatenation
        ([(8, 3), (6,), (4, 5)], 2, None),
        ([(8, 3), (7,), (4, 5)], 2, None),  # (7,) padded at 2 ranks
        ([(8, 3), (4,), (4, 5)], 2, 1),  # a missing gradient
        ([(8, 3), (4,), (4, 5)], 2, "bf16"),  # a gradient in another dtype, cast by the copy
        ([(3, 3)], 1, None),  # one rank
    ]
    draw = torch.Generator().manual_seed(33)  # and drawn ones: units of 1-5 parameters of 0-3 dims

    def pick(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=draw))

    for _ in range(40):
        shapes = [tuple(pick(1, 9) for _ in range(pick(0, 4))) for _ in range(pick(1, 6))]
        cases.append((shapes, pick(1, 5), None))
    for shapes, n, odd in cases:
        specs = [ShardSpec(torch.Size(shape), n, 0) for shape in shapes]
        grads: list[torch.Tensor | None] = [torch.randn(shape) for shape in shapes]
        if odd == 1:
            grads[1] = None
        elif odd == "bf16":
            grads[0] = grads[0].to(torch.bfloat16)  # type: ignore[union-attr]
        width = sum(spec.padded_shard_numel for spec in specs)
        expected = torch.full((n, width), float("nan"))
        offset = 0
        for spec, g in zip(specs, grads):
            pack_rows_into(expected[:, offset : offset + spec.padded_shard_numel], g, spec)
            offset += spec.padded_shard_numel
        pack = torch.full((n, width), float("nan"))
        pack_into(pack, grads, specs)
        assert torch.equal(pack, expected), (shapes, n, odd)


def create_graph_body(rank: int, world: int) -> dict:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fullshard import FullyShardedDataParallel, fully_shard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # rows 8 and 2: no padding at 1 and 2 ranks
    x = torch.randn(3, 4)
    ref(x).pow(2).sum().backward(create_graph=True)
    out = {}
    for kind in ("fully_shard", "wrapper"):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        if kind == "fully_shard":
            fully_shard(model[0])
            fully_shard(model)
        else:
            model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        model(x).pow(2).sum().backward(create_graph=True)
        grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
        diffs = []
        for name, p in ref.named_parameters():
            g = grads[name]
            assert g is not None, name
            full = g.full_tensor() if kind == "fully_shard" else g  # type: ignore[attr-defined]
            want = p.grad if kind == "fully_shard" else torch.chunk(p.grad, world)[rank]  # type: ignore[arg-type]
            diffs.append(float((full.detach() - want.detach()).abs().max()))
        out[kind] = max(diffs)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_backward_with_create_graph_packs_gradients_that_require_grad(world: int) -> None:
    """``backward(create_graph=True)`` hands the unit gradients that require grad; the pack
    must take them (the one-concatenation pack cannot: ``out=`` refuses them) and the shards'
    gradients equal the unwrapped model's, on both front ends."""
    for result in run_ranks(create_graph_body, world):
        assert result == {"fully_shard": 0.0, "wrapper": 0.0}, result


def test_the_gradient_shards_views_from_one_split_equal_each_local_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """UnitLayout.trainable_local_views gives each trainable parameter's shard of a gradient
    buffer as local_view does, for ranks holding all, part or none of a parameter's rows (the
    layout's geometry only: the group's size and rank are stood in for, nothing is sent)."""
    from fullshard.comm import collectives
    from fullshard.engine.layout import UnitLayout
    from fullshard.engine.unit_config import UnitConfig

    for n in (1, 2, 3, 4, 6):
        for rank in range(n):
            monkeypatch.setattr(collectives, "group_size", lambda group, n=n: n)
            monkeypatch.setattr(collectives, "group_rank", lambda group, rank=rank: rank)
            monkeypatch.setattr(collectives, "backend", lambda group: "gloo")
            model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))  # 5 and 2 rows: some ranks hold none
            model[1].bias.requires_grad_(False)  # frozen: laid out after the trainable ones
            params = [(name, p, []) for name, p in model.named_parameters()]
            unit = UnitLayout("u", params, object(), None, UnitConfig(torch.device("cpu")))  # type: ignore[arg-type]
            flat = torch.randn(unit.grad_numel)
            views = unit.trainable_local_views(flat)
            assert len(views) == len(unit.trainable) == 3
            for sp, view in zip(unit.trainable, views):
                expected = unit.local_view(sp, flat)
                assert view.shape == expected.shape, (n, rank, sp.fqn)
                assert view.numel() == 0 or view.data_ptr() == expected.data_ptr(), (n, rank, sp.fqn)


def own_rows_body(rank: int, world: int) -> dict:
    from fullshard import FSDP
    from fullshard.comm import collectives
    from fullshard.engine import unit as unit_mod

    group = collectives.default_group()
    # The collective: with fill_own=False our slice of the output keeps what it held.
    shard = torch.full((5,), float(rank + 1))
    out = torch.full((world * 5,), -7.0)
    collectives.all_gather(out, shard, group, fill_own=False)
    others = [r for r in range(world) if r != rank]
    result = {
        "own_untouched": bool((out.view(world, 5)[rank] == -7.0).all()),
        "others": all(bool((out.view(world, 5)[r] == r + 1).all()) for r in others),
    }
    # The engine: runs of small parameters (Linear + LayerNorm), uneven rows, every rank's
    # place (first, middle, last), gathered with the own rows straight from the shards and
    # with all rows copied out of the scratch.
    reference = make_stack()
    model = _fsdp(copy.deepcopy(reference))
    runs = [len(g) for m in FSDP.fsdp_modules(model) for g, _, _ in m.unit._pieces]
    gathered = {}
    for direct in (True, False):
        unit_mod.OWN_ROWS_DIRECT = direct
        try:
            with FSDP.summon_full_params(model):
                gathered[direct] = [p.detach().clone() for p in model.parameters()]
            # gather_full builds its copy-out targets itself (not the full buffer's views)
            gathered[(direct, "gather_full")] = [
                t for m in FSDP.fsdp_modules(model) for t in m.unit.gather_full(m.unit.local_flat)
            ]
        finally:
            unit_mod.OWN_ROWS_DIRECT = True
    expect = [p.detach() for p in reference.parameters()]
    result["runs"] = max(runs)
    result["equal"] = [all(torch.equal(a, b) for a, b in zip(gathered[d], expect)) for d in (True, False)]
    result["gather_full_equal"] = all(
        torch.equal(a, b) for a, b in zip(gathered[(True, "gather_full")], gathered[(False, "gather_full")])
    )
    result["gather_full_count"] = len(gathered[(True, "gather_full")])
    return result


def test_a_runs_own_rows_go_straight_from_the_shards_to_the_full_parameters() -> None:
    """On gloo a run of small parameters is all-gathered into a rank-major scratch buffer and
    copied out to the param-major full buffer. The own rows are not needed in the scratch: they
    are copied straight from the shards while the other ranks' rows are on the wire, and only the
    others' are copied out afterwards (one copy of the shard fewer per all-gather). The full
    parameters are the same bits either way, at 2 ranks and at 3 (a first, middle and last rank)."""
    for world in (2, 3):
        for r in run_ranks(own_rows_body, world):
            assert r["own_untouched"] and r["others"], (world, r)
            assert r["runs"] > 1, r  # the model has runs to copy out
            assert r["equal"] == [True, True], (world, r)
            assert r["gather_full_equal"] and r["gather_full_count"] > 0, (world, r)
