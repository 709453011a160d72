"""fully_shard: FSDP2's composable API on the same engine, with the wrapper's parity tests."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import batch, local, make_stack, step_both

from fullshard import probes
from fullshard.engine.hooks import fsdp_state


def _shard(model, **kw):
    from fullshard import fully_shard

    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def parity_body(rank: int, world: int) -> list[str]:
    from torch.distributed.tensor import DTensor

    from fullshard import FSDPModule
    from fullshard.engine.unit import TrainingState

    done = []
    for reshard in (True, False):
        for opt_kind in ("sgd", "adamw"):
            ref = make_stack(scale_shape=(1,))
            model = _shard(copy.deepcopy(ref), reshard_after_forward=reshard)
            assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPStack"
            assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
            make = (
                (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
                if opt_kind == "sgd"
                else (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
            )
            opt, ref_opt = make(model.parameters()), make(ref.parameters())
            for step in range(6):
                step_both(model, opt, ref, ref_opt, step, rank, world)
                states = [fsdp_state(m).unit.training_state for m in model.modules() if fsdp_state(m) is not None]
                assert all(s is TrainingState.IDLE for s in states), states
                sd = model.state_dict()
                for k, want in ref.state_dict().items():
                    assert isinstance(sd[k], DTensor), k
                    got = sd[k].full_tensor()
                    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
                    assert err <= 1e-5, f"reshard={reshard} {opt_kind} step {step} {k}: {err:.2e}"
            done.append(f"{reshard}/{opt_kind}")
    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fully_shard_parity(world: int) -> None:
    assert len(run_ranks(parity_body, world, timeout=280)[0]) == 4


def api_body(rank: int, world: int) -> list[str]:
    from fullshard import MixedPrecisionPolicy, clip_grad_norm_
    from fullshard.engine.unit import ShardState

    done = []
    mse = torch.nn.functional.mse_loss
    # set_requires_gradient_sync(False) for k micro-batches, then a synced one == one big step.
    ref = make_stack(scale_shape=(1,))
    model = _shard(copy.deepcopy(ref))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    micro = [batch(s, 12) for s in range(3)]
    model.set_requires_gradient_sync(False)
    with probes.enabled() as p:
        for x, y in micro[:2]:
            mse(model(local(x, rank, world)), local(y, rank, world)).backward()
    assert p.collectives.calls["reduce_scatter"] == 0
    model.set_requires_gradient_sync(True)
    x, y = micro[2]
    mse(model(local(x, rank, world)), local(y, rank, world)).backward()
    clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    for x, y in micro:
        mse(ref(x), y).backward()
    ref_opt.step()
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k].full_tensor(), v, rtol=1e-5, atol=1e-6)
    done.append("gradient sync")

    # unshard() / reshard() by hand.
    block = model.blocks[1]
    block.unshard()
    assert fsdp_state(block).unit.shard_state is ShardState.UNSHARDED
    block.reshard()
    handle = block.unshard(async_op=True)
    handle.wait()
    block.reshard()
    assert fsdp_state(block).unit.shard_state is ShardState.SHARDED
    done.append("unshard/reshard")

    # load_state_dict takes DTensors (resharded) and full tensors.
    other = make_stack(seed=5, scale_shape=(1,))
    fresh = _shard(copy.deepcopy(make_stack(seed=9, scale_shape=(1,))))
    fresh.load_state_dict(other.state_dict())
    donor = _shard(copy.deepcopy(other))
    again = _shard(copy.deepcopy(make_stack(seed=11, scale_shape=(1,))))
    again.load_state_dict(donor.state_dict())
    for m in (fresh, again):
        for k, v in other.state_dict().items():
            assert torch.equal(m.state_dict()[k].full_tensor(), v), k
    done.append("load")

    # MixedPrecisionPolicy: bf16 compute and wire, fp32 output at the root, fp32 shards.
    from fullshard import fully_shard

    model = make_stack(scale_shape=(1,))
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fully_shard(
        model,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        ),
    )
    out = model(local(batch(0, 12)[0], rank, world))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    done.append("mixed precision")
    return done


@pytest.mark.timeout(300)
def test_fully_shard_api() -> None:
    assert run_ranks(api_body, 2, timeout=280)[0] == ["gradient sync", "unshard/reshard", "load", "mixed precision"]


def hsdp_body(rank: int, world: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = make_stack(scale_shape=(1,))
    model = _shard(copy.deepcopy(ref), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        step_both(model, opt, ref, ref_opt, step, rank, world)
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k].full_tensor(), v, rtol=1e-5, atol=1e-6)
    return len(sd)


@pytest.mark.timeout(300)
def test_fully_shard_2d_mesh() -> None:
    assert run_ranks(hsdp_body, 4, timeout=280)[0] > 0


def test_every_name_torch_fsdp_exports_is_fullshards() -> None:
    """A program changes its import line only: every name of ``torch.distributed.fsdp.__all__``
    is fullshard's, ``fully_shard`` takes every keyword torch's does, and the FSDP1 wrapper has
    every public method torch's has (nn.Module's aside)."""
    import inspect

    import torch.distributed.fsdp as tf
    from torch import nn

    import fullshard

    assert [n for n in tf.__all__ if not hasattr(fullshard, n)] == []
    assert set(inspect.signature(tf.fully_shard).parameters) <= set(inspect.signature(fullshard.fully_shard).parameters)
    theirs = {n for n in dir(tf.FullyShardedDataParallel) if not n.startswith("_")} - set(dir(nn.Module))
    assert sorted(theirs - set(dir(fullshard.FullyShardedDataParallel))) == []
    with pytest.raises(ValueError, match="shard, replicate or both"):
        fullshard.DataParallelMeshDims()


def _names_body(rank: int, world: int) -> list[str]:
    import fullshard

    model = _shard(make_stack(scale_shape=(1,)))
    fullshard.share_comm_ctx([model, model.blocks[0]])  # one stream already: checks, changes nothing
    with pytest.raises(ValueError, match="FSDPModules"):
        fullshard.share_comm_ctx([model, torch.nn.Linear(2, 2)])
    with pytest.raises(NotImplementedError, match="dp_mesh_dims"):
        fullshard.fully_shard(torch.nn.Linear(2, 2), dp_mesh_dims=fullshard.DataParallelMeshDims(shard="dp"))
    return ["names"]


@pytest.mark.timeout(120)
def test_share_comm_ctx_and_dp_mesh_dims() -> None:
    assert run_ranks(_names_body, 1, timeout=100)[0] == ["names"]


def _by_hand_body(rank: int, world: int) -> list[str]:
    """``unshard()`` / ``unshard(async_op=True)`` + ``wait()`` before forward (the root, a block,
    every unit): each unit is all-gathered once that step, as torch's (the next forward reused
    none of them before: 8 to 11 all-gathers instead of 7), and training is bitwise torch's. A
    unit gathered after backward is gathered afresh after the optimizer step (torch's reuses the
    older values: its loss differs)."""
    import torch.distributed.fsdp as tf
    from models import TinyLM, tokens

    import fullshard as fs

    def ways(model):
        return {
            "root": lambda: model.unshard(),
            "block": lambda: model.layers[0].unshard(),
            "all async": lambda: [
                h.wait()
                for h in [model.unshard(async_op=True)] + [layer.unshard(async_op=True) for layer in model.layers]
            ],
        }

    x = [tokens(step, 2 * world)[2 * rank : 2 * rank + 2] for step in range(3)]
    for way in ways(None):
        models = []
        for mod in (tf, fs):
            torch.manual_seed(0)
            model = TinyLM(layers=3)
            for layer in model.layers:
                mod.fully_shard(layer)
            models.append(mod.fully_shard(model))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        for step in range(2):
            for model, opt in zip(models, opts):
                with probes.enabled(events=True) as p:
                    ways(model)[way]()
                    model(x[step]).logsumexp(-1).mean().backward()
                opt.step()
                opt.zero_grad()
            assert sum(e[0] == "unshard" for e in p.events) == 7, (way, p.events)
            for a, b in zip(*(m.parameters() for m in models), strict=True):
                assert torch.equal(a.to_local(), b.to_local()), (way, step)
    losses = []  # torch's model, not gathered by hand, then fullshard's, gathered before the step
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(x[2]).sum().backward()
        if model is models[1]:
            model.layers[1].unshard()
        opt.step()
        losses.append(model(x[2]).sum().item())
    assert losses[0] == losses[1], losses
    return ["by hand"]


@pytest.mark.timeout(120)
def test_unshard_by_hand_gathers_once_like_torch() -> None:
    assert run_ranks(_by_hand_body, 2, timeout=100)[0] == ["by hand"]


class _NormFirst(torch.nn.Module):
    """LayerNorm(7) then Linear(7, 7): packed back to back, the weight starts 56 bytes in."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(7)
        self.lin = torch.nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class _NormFirstStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_NormFirst() for _ in range(2)])
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _one_row_body(rank: int, world: int) -> list[str]:
    """One rank: one-row forwards and training steps are bitwise torch's ``fully_shard``'s
    (plain and bf16 compute), and the FSDP1 wrapper's bitwise an unsharded model's. Each
    parameter must start on a 64-byte line, as torch's own allocations do: a one-row
    ``F.linear`` on CPU rounds differently for a weight that starts elsewhere (packed back to
    back, 4 of 16 one-row forwards of such a model matched torch's)."""
    import torch.distributed.fsdp as tf
    from torch import nn

    import fullshard as fs
    from fullshard.frontend.wrap import ModuleWrapPolicy

    def run(model, make_opt, starts: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        def note(module, args):  # where forward reads each parameter
            starts.extend(p.data_ptr() % 64 for p in module.parameters(recurse=False))

        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                m.register_forward_pre_hook(note)
        opt, outs = make_opt(model.parameters()), []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
            outs += [model(x[i : i + 1]).detach().clone() for i in range(4)]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[:1]).float(), y[:1]).backward()
            opt.step()
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        return outs, [p.detach().clone() for p in full]

    done = []
    opts = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    }
    for (opt_kind, make_opt), dtype in ((o, d) for o in opts.items() for d in (None, torch.bfloat16)):
        got = {}
        for mod in (tf, fs):
            starts: list[int] = []
            model = _NormFirstStack()
            for block in model.blocks:
                mod.fully_shard(block, mp_policy=tf.MixedPrecisionPolicy(param_dtype=dtype))
            mod.fully_shard(model, mp_policy=tf.MixedPrecisionPolicy(param_dtype=dtype))
            got[mod.__name__] = run(model, make_opt, starts)
            if mod is fs:
                assert set(starts) == {0}, (opt_kind, dtype, starts)
                assert {p.to_local().data_ptr() % 64 for p in model.parameters()} == {0}, (opt_kind, dtype)
        for a, b in zip(*got.values(), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (opt_kind, dtype)
        done.append(f"fully_shard {opt_kind} {dtype}")
        if dtype is None:
            ref = _NormFirstStack()
            model = fs.FSDP(_NormFirstStack(), auto_wrap_policy=ModuleWrapPolicy({_NormFirst}))
            starts = []
            want, (got_outs, got_params) = run(ref, make_opt, []), run(model, make_opt, starts)
            assert set(starts) == {0}, (opt_kind, starts)
            assert all(torch.equal(x, y) for x, y in zip(want[0], got_outs, strict=True)), opt_kind
            assert all(torch.equal(x, y) for x, y in zip(want[1], got_params, strict=True)), opt_kind
            done.append(f"FSDP1 {opt_kind}")
    return done


@pytest.mark.timeout(200)
def test_one_rank_is_bitwise_torch_for_one_row_inputs() -> None:
    assert len(run_ranks(_one_row_body, 1, timeout=180)[0]) == 6
