"""Parity: every step, the sharded model's full parameters match a single-process reference."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from dist import patched, run_ranks
from models import Block, batch, local, make_stack

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STEPS = 4  # momentum and Adam moments carried through several updates
RTOL = 1e-5


def _optimizers(kind: str, fsdp_params, ref_params):
    if kind == "sgd":
        make = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        make = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    return make(fsdp_params), make(ref_params)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def run_grid(
    rank: int, world: int, grid: list[tuple[str, str, str]], direct_gather_bytes: int | None = None
) -> list[str]:
    from fullshard.engine import layout

    gather_bytes = layout.DIRECT_GATHER_BYTES if direct_gather_bytes is None else direct_gather_bytes
    with patched(layout, DIRECT_GATHER_BYTES=gather_bytes):  # restored at the end: ranks are kept between calls
        return _run_grid(rank, world, grid, direct_gather_bytes)


def _run_grid(rank: int, world: int, grid: list[tuple[str, str, str]], direct_gather_bytes: int | None) -> list[str]:
    from fullshard import FSDP, ShardingStrategy, probes
    from fullshard.engine.unit import TrainingState
    from fullshard.frontend.wrap import ModuleWrapPolicy

    checked = []
    for strategy, opt_kind, wrapping in grid:
        ref = make_stack()
        policy = ModuleWrapPolicy({Block}) if wrapping == "blocks" else None
        model = FSDP(copy.deepcopy(ref), sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=policy)
        opt, ref_opt = _optimizers(opt_kind, model.parameters(), ref.parameters())
        if direct_gather_bytes is not None:  # both kinds of piece are exercised
            kinds = {len(group) == 1 for m in model.fsdp_modules(model) for group, _, _ in m.unit._pieces}
            assert kinds == {True, False}, kinds
        local = GLOBAL_BATCH // world
        for step in range(STEPS):
            x, y = batch(step, GLOBAL_BATCH)
            with probes.enabled() as p:  # counts the units gathered from forward to the step
                loss = torch.nn.functional.mse_loss(
                    model(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local]
                )
                opt.zero_grad()
                loss.backward()
                opt.step()
            ref_loss = torch.nn.functional.mse_loss(ref(x), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            states = model.training_states()
            assert all(s is TrainingState.IDLE for s in states), (strategy, step, states)
            assert p.gathered.now == 0, f"{p.gathered.now} units still gathered after step {step}"
            full = model.state_dict()
            for name, want in ref.state_dict().items():
                err = _rel_err(full[name], want)
                assert err <= RTOL, f"{strategy}/{opt_kind}/{wrapping} step {step} {name}: rel err {err:.2e}"
        # parameters() yields shards: together they hold each parameter exactly once.
        numel = sum(p.numel() for p in model.parameters())
        totals = run_sum(numel)
        assert totals == sum(p.numel() for p in ref.parameters()) * (world if strategy == "NO_SHARD" else 1), totals
        checked.append(f"{strategy}/{opt_kind}/{wrapping}")
    return checked


def run_sum(value: int) -> int:
    from fullshard.comm import collectives

    t = torch.tensor([value], dtype=torch.int64)
    collectives.all_reduce(t, collectives.default_group())
    return int(t.item())


GRID = [
    (strategy, opt, wrapping)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for opt in ("sgd", "adamw")
    for wrapping in ("blocks", "single")
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.timeout(400)
def test_parity_grid(world: int) -> None:
    grid = GRID if world != 3 else [g for g in GRID if g[2] == "blocks"]
    results = run_ranks(run_grid, world, grid, timeout=380)
    assert results[0] == [f"{s}/{o}/{w}" for s, o, w in grid]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(300)
def test_parity_with_per_parameter_gathers(world: int) -> None:
    """Weights (padded shards of 56 bytes and more) gathered straight into the full buffer, one
    collective each, and the biases between them as runs with a copy-out: still exact."""
    from fullshard.engine import layout

    assert layout.DIRECT_GATHER_BYTES > 1000  # the default leaves these small layers to runs
    grid = [("FULL_SHARD", "adamw", "blocks"), ("FULL_SHARD", "sgd", "single"), ("SHARD_GRAD_OP", "adamw", "blocks")]
    results = run_ranks(run_grid, world, grid, 48, timeout=280)
    assert results[0] == [f"{s}/{o}/{w}" for s, o, w in grid]


def optimizer_before_wrap_body(rank: int, world: int) -> list[float]:
    """An optimizer built before wrapping (Accelerate's order) trains the wrapped model: the
    original Parameter objects stay registered, their data now this rank's shard."""
    from models import step_both

    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    ref = make_stack()
    model = copy.deepcopy(ref)
    originals = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    wrapped = FSDP(model, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in originals]
    errors = []
    for step in range(4):
        step_both(wrapped, opt, ref, ref_opt, step, rank, world)
        full = wrapped.state_dict()
        errors.append(max(_rel_err(full[k], v) for k, v in ref.state_dict().items()))
    return errors


@pytest.mark.timeout(200)
def test_optimizer_built_before_wrapping_trains() -> None:
    errors = run_ranks(optimizer_before_wrap_body, 2, timeout=180)[0]
    assert max(errors) <= RTOL, errors


class _FailOnce(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("boom in backward")
        return g


def irregular_loop_body(rank: int, world: int, strategy: str) -> list[str]:
    """A forward with grad enabled and no backward (a metric) between backward and step; then a
    backward that raises and is retried."""
    from fullshard import FSDP, ShardingStrategy
    from fullshard.engine.unit import ShardState, TrainingState
    from fullshard.frontend.wrap import ModuleWrapPolicy

    mse = torch.nn.functional.mse_loss
    done = []
    ref = make_stack()
    model = FSDP(
        copy.deepcopy(ref), sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=ModuleWrapPolicy({Block})
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step, 8)
        opt.zero_grad()
        ref_opt.zero_grad()
        mse(model(local(x, rank, world)), local(y, rank, world)).backward()
        mse(ref(x), y).backward()
        model(x)  # without torch.no_grad(): leaves gathered units behind
        opt.step()
        ref_opt.step()
        out = model(x)
        torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-5)  # no stale parameters; float32 sums differ
        out.sum().backward()
        opt.zero_grad()
    done.append("forward without backward")

    _FailOnce.armed = True
    xs = local(batch(0, 8)[0], rank, world).requires_grad_()
    with pytest.raises(RuntimeError, match="boom in backward"):
        model(_FailOnce.apply(xs)).sum().backward()
    opt.zero_grad()
    model(_FailOnce.apply(xs)).sum().backward()
    assert all(s is TrainingState.IDLE for s in model.training_states())
    assert all(m.unit.shard_state is ShardState.SHARDED for m in model.fsdp_modules(model))
    assert all(p.grad is not None for p in model.parameters())
    done.append("backward raised")
    return done


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_forward_without_backward_and_a_backward_that_raises(strategy: str) -> None:
    assert run_ranks(irregular_loop_body, 2, strategy, timeout=180)[0] == [
        "forward without backward",
        "backward raised",
    ]


def kept_forward_body(rank: int, world: int) -> list[str]:
    """Forwards with grad whose outputs are kept and never backwarded (a metric kept for logging;
    the micro-batches a pipeline schedule runs before their backwards), on both front ends, with
    ``reshard_after_forward`` False and True: a later forward reads what an optimizer step or an
    in-place edit of the shards made, never the parameters gathered before; while the shards are
    unchanged, units that keep their parameters after forward serve it without an all-gather;
    ``param.data = ...`` on a shard makes every rank gather again, one whose shard is empty too."""
    from fullshard import FSDP, ShardingStrategy, fully_shard, probes
    from fullshard.engine import hooks
    from fullshard.engine.unit import ShardState, TrainingState
    from fullshard.frontend.wrap import ModuleWrapPolicy

    mse = torch.nn.functional.mse_loss
    done = []
    for front in ("wrapper", "fully_shard"):
        for keep in (True, False):  # keep: reshard_after_forward=False (SHARD_GRAD_OP for the wrapper)
            ref = make_stack(scale_shape=(1,))
            if front == "wrapper":
                strategy = ShardingStrategy.SHARD_GRAD_OP if keep else ShardingStrategy.FULL_SHARD
                model = FSDP(copy.deepcopy(ref), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
            else:
                model = copy.deepcopy(ref)
                for block in model.blocks:
                    fully_shard(block, reshard_after_forward=not keep)
                fully_shard(model, reshard_after_forward=not keep)
            opt, ref_opt = _optimizers("sgd", model.parameters(), ref.parameters())
            shards = {n.rsplit(".", 1)[-1]: p for n, p in model.named_parameters()}
            units = list({id(s.unit): s.unit for m in model.modules() if (s := hooks.fsdp_state(m))}.values())
            tag = f"{front}, reshard_after_forward={not keep}"
            for step in range(3):
                x, y = batch(step, 8)
                mse(model(local(x, rank, world)), local(y, rank, world)).backward()
                mse(ref(x), y).backward()
                kept = model(x)  # never backwarded: its graph holds the gathered parameters
                opt.step()
                ref_opt.step()
                after_step = model(x)
                torch.testing.assert_close(after_step, ref(x), rtol=1e-4, atol=1e-5, msg=f"{tag}: after the step")
                with torch.no_grad():  # an in-place edit of the shards (a hand-written decay)
                    for p, q in zip(model.parameters(), ref.parameters()):
                        p.mul_(0.9)
                        q.mul_(0.9)
                after_edit = model(x)
                torch.testing.assert_close(after_edit, ref(x), rtol=1e-4, atol=1e-5, msg=f"{tag}: after the edit")
                with probes.enabled() as p:
                    unchanged = model(x)
                gathers = p.collectives.calls["all_gather"]
                assert torch.equal(unchanged, after_edit), tag
                # Units that reshard after forward gather again (the wrapper's root, kept, does not).
                assert (gathers == 0) if keep else (0 < gathers <= len(units)), (tag, gathers)
                if front == "wrapper":  # `.data =` on the shard the optimizer holds (an init scheme)
                    with torch.no_grad():  # rank 1's shard of the 1-element scale is empty
                        shards["scale"].data = shards["scale"].data * 0.5
                        ref.scale.mul_(0.5)
                    with probes.enabled() as p:
                        after_assign = model(x)  # a hang if rank 1 reused what rank 0 gathers again
                    torch.testing.assert_close(after_assign, ref(x), rtol=1e-4, atol=1e-5, msg=f"{tag}: .data")
                    assert p.collectives.calls["all_gather"] > 0, tag
                del kept, after_step, after_edit, unchanged
                opt.zero_grad()
                ref_opt.zero_grad()
            x, y = batch(3, 8)
            mse(model(local(x, rank, world)), local(y, rank, world)).backward()
            states = {(u.shard_state, u.training_state) for u in units}
            assert states == {(ShardState.SHARDED, TrainingState.IDLE)}, (tag, states)
            done.append(tag)
    return done


@pytest.mark.timeout(200)
def test_kept_forwards_never_read_parameters_an_optimizer_step_changed() -> None:
    assert len(run_ranks(kept_forward_body, 2, timeout=180)[0]) == 4
