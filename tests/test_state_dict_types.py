"""state_dict_type: full (rank0_only, offload), sharded and local state dicts; optimizer state by name."""

from __future__ import annotations

import copy

import pytest
import torch
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
        done.append(kind.name)
    # rank0_only: the other ranks get nothing.
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ):
        sd = model.state_dict()
    assert (len(sd) > 0) == (rank == 0)
    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_types_and_optimizer_state(world: int) -> None:
    assert run_ranks(types_body, world, timeout=280)[0] == ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]


UNIT_MB = 4 * 2048 * 2048 / 2**20


def rank0_memory_body(rank: int, world: int) -> tuple[float, int]:
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
    return (peak_rss_bytes() - before) / 2**20, len(sd)


@pytest.mark.timeout(200)
def test_rank0_only_full_state_dict_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed blocks go back to the OS
    (r0, n0), (r1, n1) = run_ranks(rank0_memory_body, 2, timeout=180)
    assert n0 == 8 and n1 == 0
    assert r0 >= 8 * UNIT_MB  # rank 0 holds the whole model on CPU
    assert r1 <= 2 * UNIT_MB, r1  # rank 1 holds one unit at a time
