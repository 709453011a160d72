"""state_dict_type: full (rank0_only, offload), sharded and local state dicts; optimizer state by name."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from models import Block, make_stack, step_both
from torch import nn


def _pair():
    from fullshard import FSDP
    from fullshard.frontend.wrap import ModuleWrapPolicy

    ref = make_stack()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({Block}))
    return ref, model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)


def types_body(rank: int, world: int) -> list[str]:
    from torch.distributed.tensor import DTensor

    from fullshard import FSDP, FullStateDictConfig, StateDictType

    done = []
    ref, model, opt, ref_opt = _pair()
    for step in range(3):
        step_both(model, opt, ref, ref_opt, step, rank, world)
    # Full optimizer state by name equals the unsharded optimizer's.
    osd = FSDP.optim_state_dict(model, opt)
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    for p, st in ref_opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(osd["state"][ref_names[id(p)]][k], st[k], rtol=1e-5, atol=1e-7)
    # A fresh model and optimizer load both and then train exactly like the reference.
    for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(model, kind):
            sd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        if kind is StateDictType.SHARDED_STATE_DICT:
            assert isinstance(sd["stem.weight"], DTensor) and isinstance(
                osd["state"]["stem.weight"]["exp_avg"], DTensor
            )
        _, fresh, fresh_opt, _ = _pair()
        with FSDP.state_dict_type(fresh, kind):
            fresh.load_state_dict(sd)
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
        ref2 = copy.deepcopy(ref)
        ref_opt2 = torch.optim.AdamW(ref2.parameters(), lr=1e-2)
        ref_opt2.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # load_state_dict may alias its input
        step_both(fresh, fresh_opt, ref2, ref_opt2, 5, rank, world)
        full = fresh.state_dict()
        for k, v in ref2.state_dict().items():
            torch.testing.assert_close(
                full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, kind=kind: f"{kind.name} {k}: {m}"
            )
        if kind is StateDictType.LOCAL_STATE_DICT:  # as if saved at another world size: named
            grown = {k: torch.cat([v, v[:1]]) if k == "stem.weight" else v for k, v in sd.items()}
            with FSDP.state_dict_type(fresh, kind), pytest.raises(RuntimeError, match="load it at that world size"):
                fresh.load_state_dict(grown)
        done.append(kind.name)
    # rank0_only: the other ranks get nothing.
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ):
        sd = model.state_dict()
    assert (len(sd) > 0) == (rank == 0)
    _optim_rank0_only(model, opt, rank, done)
    _optim_arguments(model, opt, ref, ref_opt, done)
    return done


def _optim_rank0_only(model: nn.Module, opt: torch.optim.Optimizer, rank: int, done: list[str]) -> None:
    """FullOptimStateDictConfig(rank0_only=True): only rank 0 receives the state, and loading takes
    it from rank 0 alone (the others pass None); load_directly loads it into the optimizer."""
    from fullshard import FSDP, FullOptimStateDictConfig, FullStateDictConfig, StateDictType

    configs = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=True))
    with FSDP.state_dict_type(model, *configs):
        osd = FSDP.optim_state_dict(model, opt)
    assert bool(osd["state"]) if rank == 0 else osd == {}  # torch's gives the other ranks {}
    _, fresh, fresh_opt, _ = _pair()
    with FSDP.state_dict_type(fresh, *configs):
        FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd if rank == 0 else None, load_directly=True)
    mine = {n: p for n, p in model.named_parameters()}
    for name, p in fresh.named_parameters():
        for key, value in opt.state[mine[name]].items():
            assert torch.equal(fresh_opt.state[p][key], value), (name, key)
    done.append("rank0_only optimizer state")


def _warns(fn: Any, text: str) -> Any:
    with pytest.warns(UserWarning, match=text):
        return fn()


def _optim_arguments(model: nn.Module, opt: Any, ref: nn.Module, ref_opt: Any, done: list[str]) -> None:
    """Every argument of the optimizer-state methods either works or warns; wrong types name the fix."""
    from fullshard import FSDP, FullStateDictConfig, ShardedOptimStateDictConfig, StateDictType

    # optim_state_dict= (optim.state_dict(), as torch's example passes it) gives the same dict.
    given = FSDP.optim_state_dict(model, opt, optim_state_dict=opt.state_dict())
    plain = FSDP.optim_state_dict(model, opt)
    assert given["param_groups"] == plain["param_groups"] and given["state"].keys() == plain["state"].keys()
    for name, entry in plain["state"].items():
        assert all(torch.equal(torch.as_tensor(given["state"][name][k]), torch.as_tensor(v)) for k, v in entry.items())
    _warns(lambda: FSDP.optim_state_dict(model, opt, group=dist.group.WORLD), "group=")
    _warns(lambda: FSDP.optim_state_dict_to_load(model, opt, plain, group=dist.group.WORLD), "group=")
    _warns(lambda: FSDP.optim_state_dict_to_load(model, opt, plain, is_named_optimizer=True), "is_named_optimizer")
    _warns(lambda: model.state_dict(keep_vars=True), "keep_vars")
    with pytest.warns(UserWarning, match="state_dict_config.rank0_only=True under SHARDED_STATE_DICT"):
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, FullStateDictConfig(rank0_only=True))
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
    with pytest.raises(TypeError, match=r"optim_state_dict: model must be the root module .* got Stack with none"):
        FSDP.optim_state_dict(ref, ref_opt)
    with pytest.raises(TypeError, match="optim_state_dict_to_load: model must be the root module"):
        FSDP.optim_state_dict_to_load(ref, ref_opt, plain)
    with pytest.raises(TypeError, match="optim must be a torch.optim.Optimizer, got str"):
        FSDP.optim_state_dict(model, "adam")
    with pytest.raises(TypeError, match=r"optim_state_dict must be an optimizer state dict .*got list"):
        FSDP.optim_state_dict_to_load(model, opt, [plain])
    with pytest.raises(ValueError, match="optim_state_dict: 99 is not a parameter id of optim"):
        FSDP.optim_state_dict(model, opt, optim_state_dict={"state": {99: {}}, "param_groups": []})
    with warnings.catch_warnings(record=True) as caught:  # sharded configs on CPU: offload_to_cpu holds already
        warnings.simplefilter("always")
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, None, ShardedOptimStateDictConfig(True)):
            assert FSDP.optim_state_dict(model, opt)["state"]
    assert not [w for w in caught if "is not used" in str(w.message)], [str(w.message) for w in caught]
    done.append("optimizer-state arguments")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_types_and_optimizer_state(world: int) -> None:
    assert run_ranks(types_body, world, timeout=280)[0] == [
        "FULL_STATE_DICT",
        "SHARDED_STATE_DICT",
        "LOCAL_STATE_DICT",
        "rank0_only optimizer state",
        "optimizer-state arguments",
    ]


UNIT_MB = 4 * 2048 * 2048 / 2**20


def rank0_memory_body(rank: int, world: int) -> tuple[float, int, float]:
    from fullshard import FSDP, FullStateDictConfig, StateDictType, peak_rss_bytes
    from fullshard.frontend.wrap import ModuleWrapPolicy

    with torch.device("meta"):
        warm = nn.Sequential(nn.Linear(2048, 1024, bias=False))
    warm = FSDP(warm)
    warm.state_dict()
    del warm
    with torch.device("meta"):  # built shard by shard, so building sets no high-water mark
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    before = peak_rss_bytes()
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ):
        sd = model.state_dict()
    held = sum(t.numel() * t.element_size() for t in sd.values() if t.device.type == "cpu")
    return (peak_rss_bytes() - before) / 2**20, len(sd), held / 2**20


@pytest.mark.timeout(200)
def test_rank0_only_full_state_dict_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed blocks go back to the OS
    (r0, n0, held0), (r1, n1, held1) = run_ranks(rank0_memory_body, 2, timeout=180, fresh=True)
    assert n0 == 8 and n1 == 0
    assert held0 == 8 * UNIT_MB and held1 == 0  # rank 0 holds the whole model on CPU, exactly
    # and its peak RSS grew by most of it (memory freed earlier in the process can be reused:
    # 124.5 MiB of the 128 measured)
    assert r0 >= 6 * UNIT_MB, r0
    assert r1 <= 2 * UNIT_MB, r1  # rank 1 holds one unit at a time
