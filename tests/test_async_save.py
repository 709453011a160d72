"""``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, optim)`` on fully_shard.

Two ranks train one seeded TinyLM sharded by torch's ``fully_shard`` and one sharded by
fullshard's (same data), each async-saves model and AdamW state to its own directory, trains one
more step before waiting on the result (the save must hold the values at the call), and then
fresh models of both kinds load each checkpoint: parameters and optimizer state equal the saved
ones bitwise, and a step after the load gives the trained models' next step.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from test_fsdp2_contract import assert_same_params, my_tokens, pair, train_step


def _flat_state(osd: dict) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for key, entry in osd["state"].items():
        for name, value in entry.items():
            out[f"{key}.{name}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


def _snapshot(model, opt) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {k: v.full_tensor().clone() for k, v in msd.items()}, {k: v.clone() for k, v in _flat_state(osd).items()}


def _load(kind: int, path: str, seed: int):
    """A fresh model (0: torch's fully_shard, 1: fullshard's) and AdamW, loaded from ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = pair(seed=seed)[kind]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return model, opt


def async_body(rank: int, world: int, tmp: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # A group of its own for each save: async_save on the default gloo group can abort the run,
    # and two saves in flight on one group interleave their collectives (a deadlock).
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    trained = list(pair())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in trained]
    for step in range(2):
        for model, opt in zip(trained, opts):
            train_step(model, opt, my_tokens(step, rank, world))
    assert_same_params(*trained, "trained")
    saved = [_snapshot(m, o) for m, o in zip(trained, opts)]
    futures = []
    for name, model, opt, group in zip(("torch", "fullshard"), trained, opts, groups):
        msd, osd = get_state_dict(model, opt)
        futures.append(dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/{name}", process_group=group))
    for model, opt in zip(trained, opts):  # training goes on while the checkpoint is written
        train_step(model, opt, my_tokens(2, rank, world))
    for future in futures:
        future.result()
    done = []
    for src in ("torch", "fullshard"):
        for kind in (0, 1):
            model, opt = _load(kind, f"{tmp}/{src}", seed=7)
            params, state = _snapshot(model, opt)
            for want_params, want_state in saved:
                assert params.keys() == want_params.keys() and state.keys() == want_state.keys()
                for key, value in {**params, **state}.items():
                    want = want_params[key] if key in want_params else want_state[key]
                    assert torch.equal(value, want), (src, kind, key)
            train_step(model, opt, my_tokens(2, rank, world))
            assert_same_params(trained[0], model, f"{src} checkpoint into {('torch', 'fullshard')[kind]}, resumed")
            done.append(f"{src}->{('torch', 'fullshard')[kind]}")
    return done


@pytest.mark.timeout(300)
def test_async_save_matches_torch(tmp_path) -> None:
    done = run_ranks(async_body, 2, str(tmp_path), timeout=280)[0]
    assert done == ["torch->torch", "torch->fullshard", "fullshard->torch", "fullshard->fullshard"]


def fsdp1_body(rank: int, world: int, tmp: str) -> int:
    """The FSDP1 wrapper's SHARDED_STATE_DICT (DTensors over its flat buffers) async-saved, then
    loaded into a fresh wrapper: the same parameters. (tests/test_torch_fsdp1.py loads DCP checkpoints
    across torch's FSDP1, run on CPU with device_id, and this wrapper.)"""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from models import Block, make_stack, step_both

    from fullshard import FSDP, StateDictType
    from fullshard.frontend.wrap import ModuleWrapPolicy

    def wrapped(seed: int):
        return FSDP(make_stack(seed), auto_wrap_policy=ModuleWrapPolicy({Block}))

    model, ref = wrapped(0), make_stack(0)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step_both(model, opt, ref, ref_opt, 0, rank, world)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = model.state_dict()
        want = {k: v.full_tensor().clone() for k, v in state.items()}
        dcp.async_save(state, checkpoint_id=tmp, process_group=dist.new_group(backend="gloo")).result()
    fresh = wrapped(5)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=tmp)
        fresh.load_state_dict(state)
        got = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    assert got.keys() == want.keys()
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    return len(got)


@pytest.mark.timeout(200)
def test_async_save_fsdp1_sharded_state_dict(tmp_path) -> None:
    assert run_ranks(fsdp1_body, 2, str(tmp_path), timeout=180)[0] > 0


def checkpointed_body(rank: int, world: int, tmp: str) -> int:
    """Layers under torch's ``checkpoint_wrapper`` (activation checkpointing applied before
    fully_shard, as torchtune does): the wrapper's own state-dict hook renames the keys, and
    ``model.state_dict()`` must still give wrappers at storage offset 0 for ``async_save``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from models import TinyLM
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    import fullshard

    def sharded(seed: int) -> TinyLM:
        torch.manual_seed(seed)
        model = TinyLM(layers=2)
        apply_activation_checkpointing(model, check_fn=lambda m: m in set(model.layers))
        for layer in model.layers:
            fullshard.fully_shard(layer)
        return fullshard.fully_shard(model)

    model = sharded(0)
    train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), my_tokens(0, rank, world))
    state = model.state_dict()
    assert "layers.0.w1.weight" in state, list(state)  # the wrapper's prefix is gone
    assert all(v.storage_offset() == 0 for v in state.values()), {k: v.storage_offset() for k, v in state.items()}
    want = {k: v.full_tensor().clone() for k, v in state.items()}
    dcp.async_save(state, checkpoint_id=tmp, process_group=dist.new_group(backend="gloo")).result()
    fresh = sharded(5)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    fresh.load_state_dict(state)
    got = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return len(got)


@pytest.mark.timeout(200)
def test_async_save_with_activation_checkpointing(tmp_path) -> None:
    """It failed: 'Attempted to call copy_() on an invalid python storage' (the keys fullshard's
    hook looked for had the wrapper's prefix)."""
    assert run_ranks(checkpointed_body, 2, str(tmp_path), timeout=180)[0] > 0
