"""torch FSDP1's older optimizer-state functions, and wrapping by hand (enable_wrap / wrap).

One ``run_ranks`` call per world size runs the grid. For AdamW and SGD with momentum, after two
steps, each way of saving and loading the optimizer state must let a freshly wrapped model
continue exactly like the unsharded reference. Two models: ``Stack`` (13- and 7-row layers
and a 0-dim parameter) and ``_plain`` (no 0-dim parameter, for the calls without ``optim``,
which cannot place a 0-dim parameter's state).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist import run_ranks
from models import Block, make_stack, step_both
from torch import nn

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def _plain(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Block(6, 13), Block(13, 7), nn.Linear(7, 3))


MODELS = {"stack": make_stack, "plain": _plain}


def _wrapped(kind: str, seed: int = 0) -> nn.Module:
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    return FSDP(MODELS[kind](seed), auto_wrap_policy=ModuleWrapPolicy({Block}))


def _trained(kind: str, opt_name: str, rank: int, world: int):
    """A reference, a wrapped copy and their optimizers after two identical steps."""
    ref = MODELS[kind]()
    model = _wrapped(kind)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    for step in range(2):
        step_both(model, opt, ref, ref_opt, step, rank, world)
    return ref, model, opt, ref_opt


def _resume(case: str, kind: str, opt_name: str, ref, ref_opt, model, load, rank: int, world: int) -> None:
    """A fresh wrapped model takes ``model``'s weights, ``load(fresh, fresh_opt)`` its optimizer
    state; two more steps must match the reference continuing uninterrupted."""
    fresh = _wrapped(kind, seed=7)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = OPTIMIZERS[opt_name](fresh.parameters())
    load(fresh, fresh_opt)
    ref2 = copy.deepcopy(ref)
    ref_opt2 = OPTIMIZERS[opt_name](ref2.parameters())
    ref_opt2.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for step in (5, 6):
        step_both(fresh, fresh_opt, ref2, ref_opt2, step, rank, world)
    full = fresh.state_dict()
    for k, v in ref2.state_dict().items():
        torch.testing.assert_close(
            full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{case} {kind} {opt_name} {k}: {m}"
        )


def _raises(fn, exc, *texts: str) -> None:
    try:
        fn()
    except exc as e:
        assert all(t in str(e) for t in texts), f"{texts} not all in {e}"
        return
    raise AssertionError(f"no {exc.__name__} mentioning {texts}")


def _check_full(full: dict, ref, ref_opt, new: dict) -> None:
    """Keyed by names; values equal ``new`` (optim_state_dict under FULL_STATE_DICT) and the reference's."""
    names = {id(p): n for n, p in ref.named_parameters()}
    assert set(full["state"]) == set(names.values())
    assert [g["params"] for g in full["param_groups"]] == [
        [names[id(p)] for p in g["params"]] for g in ref_opt.param_groups
    ]
    assert new["param_groups"] == full["param_groups"]
    for name, entry in new["state"].items():
        assert entry.keys() == full["state"][name].keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(full["state"][name][key])), (name, key)
    _check_values(full, ref, ref_opt)


def _check_values(full: dict, ref, ref_opt) -> None:
    names = {id(p): n for n, p in ref.named_parameters()}
    for p, st in ref_opt.state.items():
        for key, value in st.items():
            torch.testing.assert_close(
                full["state"][names[id(p)]][key],
                value,
                rtol=1e-4,
                atol=1e-7,
                msg=lambda m, n=names[id(p)], k=key: f"{n}.{k}: {m}",
            )


def _grid_stack(opt_name: str, rank: int, world: int, done: list[str]) -> None:
    """Every function on Stack (a 0-dim parameter: the optimizer is passed where it may be)."""
    from fullshard import FSDP, OptimStateKeyType

    ref, model, opt, ref_opt = _trained("stack", opt_name, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_rank0 = FSDP.full_optim_state_dict(model, opt)  # rank0_only=True by default
    assert any(issubclass(w.category, FutureWarning) and "optim_state_dict" in str(w.message) for w in caught)
    full = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    new = FSDP.optim_state_dict(model, opt)  # collective: every rank
    _check_full(full, ref, ref_opt, new)
    if rank == 0:
        _check_full(on_rank0, ref, ref_opt, new)
    else:
        assert on_rank0 == {}
    sharded = FSDP.sharded_optim_state_dict(model, opt)
    loads = {
        "shard": lambda m, o: o.load_state_dict(FSDP.shard_full_optim_state_dict(full, m, optim=o)),
        "scatter": lambda m, o: o.load_state_dict(
            FSDP.scatter_full_optim_state_dict(on_rank0 if rank == 0 else None, m, optim=o)
        ),
        "to_load": lambda m, o: o.load_state_dict(FSDP.optim_state_dict_to_load(m, o, full)),
        "flatten": lambda m, o: o.load_state_dict(FSDP.flatten_sharded_optim_state_dict(sharded, m, o)),
        "rekey_name": lambda m, o: o.load_state_dict(
            FSDP.shard_full_optim_state_dict(
                FSDP.rekey_optim_state_dict(ref_opt.state_dict(), OptimStateKeyType.PARAM_NAME, ref, optim=ref_opt),
                m,
                optim=o,
            )
        ),
    }
    for case, load in loads.items():
        _resume(case, "stack", opt_name, ref, ref_opt, model, load, rank, world)
        done.append(f"stack-{opt_name}-{case}")
    # Names -> ids: an unwrapped model's optimizer loads it and holds the reference's state.
    for how in ("optim", "order", "optim_input"):
        ref3 = copy.deepcopy(ref)
        ref_opt3 = OPTIMIZERS[opt_name](ref3.parameters())
        ids_from = {
            "optim": {"optim": ref_opt3},
            "order": {},
            "optim_input": {"optim_input": [{"params": list(ref3.parameters())}]},
        }[how]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, ref3, **ids_from)
        assert any("optim_input" in str(w.message) for w in caught) == (how == "optim_input")
        ref_opt3.load_state_dict(by_id)
        expected, got = ref_opt.state_dict(), ref_opt3.state_dict()
        assert got["param_groups"] == expected["param_groups"]
        assert got["state"].keys() == expected["state"].keys()
        for i, st in expected["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(got["state"][i][key], value, rtol=1e-4, atol=1e-7)
        assert (
            FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, ref3)["state"].keys()
            == full["state"].keys()
        )
        done.append(f"stack-{opt_name}-rekey_id-{how}")


def _grid_plain(opt_name: str, rank: int, world: int, done: list[str]) -> None:
    """The calls without ``optim`` (ids in model.parameters() order), as the T5 example makes them."""
    from fullshard import FSDP

    ref, model, opt, ref_opt = _trained("plain", opt_name, rank, world)
    full = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    on_rank0 = FSDP.full_optim_state_dict(model, opt)
    loads = {
        "shard_no_optim": lambda m, o: o.load_state_dict(FSDP.shard_full_optim_state_dict(full, m)),
        "scatter_no_optim": lambda m, o: o.load_state_dict(
            FSDP.scatter_full_optim_state_dict(on_rank0 if rank == 0 else None, m)
        ),
    }
    for case, load in loads.items():
        _resume(case, "plain", opt_name, ref, ref_opt, model, load, rank, world)
        done.append(f"plain-{opt_name}-{case}")
    # The dicts are snapshots: neither the optimizers loaded from them nor the original one,
    # stepping on, change them (AdamW's step counters are stepped in place).
    spare = copy.deepcopy(ref)
    step_both(model, opt, spare, OPTIMIZERS[opt_name](spare.parameters()), 9, rank, world)
    for saved in (full, on_rank0) if rank == 0 else (full,):
        _check_values(saved, ref, ref_opt)


def _errors(rank: int, world: int, done: list[str]) -> None:
    """Bad input: a clear error naming the argument and the fix, on every rank, never a hang."""
    from fullshard import FSDP

    ref, model, opt, ref_opt = _trained("stack", "sgd", rank, world)
    full = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    fresh = _wrapped("stack")
    fresh_opt = OPTIMIZERS["sgd"](fresh.parameters())
    _raises(
        lambda: FSDP.shard_full_optim_state_dict(ref_opt.state_dict(), fresh, optim=fresh_opt),
        ValueError,
        "keyed by parameter ids",
        "rekey_optim_state_dict",
    )
    _raises(lambda: FSDP.shard_full_optim_state_dict(full, fresh), ValueError, "'scale' is 0-dim", "optim=")
    _raises(lambda: FSDP.rekey_optim_state_dict(full, "name", ref), TypeError, "optim_state_key_type", "PARAM_NAME")
    _raises(lambda: FSDP.full_optim_state_dict(ref, ref_opt), ValueError, "contains no FullyShardedDataParallel")
    two_groups = torch.optim.SGD([{"params": [p]} for p in fresh.parameters()][:2], lr=0.1)
    _raises(
        lambda: FSDP.shard_full_optim_state_dict(full, fresh, optim=two_groups),
        ValueError,
        "1 parameter groups but optim has 2",
    )
    _raises(
        lambda: FSDP.scatter_full_optim_state_dict(None, fresh, optim=fresh_opt),
        ValueError,
        "full_optim_state_dict is None on rank 0",
    )
    _raises(lambda: FSDP.full_optim_state_dict("model", opt), TypeError, "model must be an nn.Module, got str")
    _raises(lambda: FSDP.sharded_optim_state_dict(model, [opt]), TypeError, "optim must be a torch.optim.Optimizer")
    # optim_input where nothing reads it warns that it is not used (where it is read: deprecated).
    params = list(model.parameters())
    with pytest.warns(UserWarning, match="optim_input is not used: the parameters are read from optim"):
        FSDP.full_optim_state_dict(model, opt, optim_input=params, rank0_only=False)
    with pytest.warns(UserWarning, match="optim_input is not used"):
        FSDP.shard_full_optim_state_dict(full, fresh, optim_input=params, optim=fresh_opt)
    done.append("errors")


def _manual_wrap(rank: int, world: int, done: list[str]) -> None:
    """wrap() outside enable_wrap is the identity; inside it builds FSDP units that train."""
    from fullshard import FSDP, ShardingStrategy
    from fullshard.frontend.wrap import enable_wrap, wrap

    block = Block(4, 4)
    assert wrap(block) is block
    with enable_wrap(wrapper_cls=FSDP, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP):
        inner = wrap(Block(4, 4))
        overridden = wrap(Block(4, 4), sharding_strategy=ShardingStrategy.FULL_SHARD)
        ref = make_stack()
        model = copy.deepcopy(ref)
        model.blocks = nn.ModuleList([wrap(b) for b in model.blocks])
    assert isinstance(inner, FSDP) and inner.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert isinstance(overridden, FSDP) and overridden.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert wrap(block) is block  # the context is gone
    model = FSDP(model)
    assert len(FSDP.fsdp_modules(model)) == 5
    opt, ref_opt = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](ref.parameters())
    for step in range(2):
        step_both(model, opt, ref, ref_opt, step, rank, world)
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)
    done.append("manual_wrap")


def legacy_body(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    done: list[str] = []
    for opt_name in OPTIMIZERS:
        _grid_stack(opt_name, rank, world, done)
        _grid_plain(opt_name, rank, world, done)
    _errors(rank, world, done)
    _manual_wrap(rank, world, done)
    return done


EXPECTED = [
    *[
        case
        for o in OPTIMIZERS
        for case in (
            *(
                f"stack-{o}-{c}"
                for c in (
                    "shard",
                    "scatter",
                    "to_load",
                    "flatten",
                    "rekey_name",
                    "rekey_id-optim",
                    "rekey_id-order",
                    "rekey_id-optim_input",
                )
            ),
            f"plain-{o}-shard_no_optim",
            f"plain-{o}-scatter_no_optim",
        )
    ],
    "errors",
    "manual_wrap",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_legacy_optim_state_functions(world: int) -> None:
    results = run_ranks(legacy_body, world, timeout=220)
    assert all(r == EXPECTED for r in results), results


class _Recorder(nn.Module):
    """A stand-in wrapper class that records its constructor arguments."""

    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__()
        self.inner, self.kwargs = module, kwargs


@pytest.mark.timeout(30)
def test_enable_wrap_and_wrap() -> None:
    from fullshard.frontend.wrap import enable_wrap, wrap

    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin
    with enable_wrap(wrapper_cls=_Recorder, a=1, b=2):
        w = wrap(lin, b=3, c=4)
        assert isinstance(w, _Recorder) and w.inner is lin and w.kwargs == {"a": 1, "b": 3, "c": 4}
        lin._wrap_overrides = {"a": 9}  # a module's own overrides win, as in torch
        assert wrap(lin, a=5).kwargs == {"a": 9, "b": 2}
        del lin._wrap_overrides
        with pytest.raises(NotImplementedError, match="do not nest"):
            with enable_wrap(wrapper_cls=_Recorder):
                pass
        assert isinstance(wrap(lin), _Recorder)  # the failed nesting left the outer context alone
    assert wrap(lin) is lin
    with pytest.raises(RuntimeError, match="boom"):
        with enable_wrap(wrapper_cls=_Recorder):
            raise RuntimeError("boom")
    assert wrap(lin) is lin  # an exception inside the context still ends it
    with pytest.raises(TypeError, match="wrapper_cls"):
        with enable_wrap(wrapper_cls=None):  # type: ignore[arg-type]
            pass
