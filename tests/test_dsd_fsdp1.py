"""torch's DCP state-dict functions (``get_state_dict`` / ``set_state_dict``) on the FSDP1 wrapper.

A script that trains torch's FSDP1 and checkpoints with ``torch.distributed.checkpoint`` runs on
fullshard with its import line changed. torch's functions used to take fullshard's wrapper for a
plain module: the optimizer state came back as this rank's rows under whole-tensor names (also
with ``full_state_dict=True``), and ``dcp.save`` kept one rank's rows, losing the others'.

Checked against torch's own FSDP1 in one process group: the full model and optimizer state
``get_state_dict`` returns (bitwise at 2 ranks); a sharded DCP checkpoint saved at 2 ranks and
loaded at 3 (and at 3 loaded at 2) through ``set_state_dict``, by fullshard and across
implementations (a checkpoint torch's FSDP1 wrote loads into fullshard's wrapper and back),
restores the saved state bit for bit and trains on as torch's does; a full state dict held by
rank 0 alone loads with ``broadcast_from_rank0``, also into HYBRID_SHARD wrappers at 4 ranks
(with ``cpu_offload=True`` the full state is the world's rank 0's alone); a model holding both
implementations' wrappers is refused. A root that is no wrapper, holding wrapped children (torch's functions take it):
``get_state_dict`` gives torch's state, and ``nn.Module.load_state_dict`` on it (what
``set_state_dict`` calls) loads each wrapper's part, with torch's missing and unexpected keys.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import make_stack
from test_torch_fsdp1 import _cls, _opt, _same, _step, _wrap

pytestmark = pytest.mark.filterwarnings("ignore")


def _build(kind: str, seed: int, plain_root: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The Stack wrapped a unit per Block; ``plain_root``: a Sequential that is no wrapper,
    holding wrapped children only (torch's functions take such a root too)."""
    if not plain_root:
        model = _wrap(kind, make_stack(seed=seed, scale_shape=(1,)), use_orig_params=True)
        return model, _opt("adamw", model.parameters())
    stack = make_stack(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.nn.Sequential(
            *(
                _cls(kind)(m, device_id=torch.device("cpu"), use_orig_params=True)
                for m in (stack.stem, stack.blocks[0], stack.blocks[1], torch.nn.Linear(7, 3))
            )
        )
    return model, _opt("adamw", model.parameters())


def _copied(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copied(v) for v in tree]
    return tree.detach().clone() if isinstance(tree, torch.Tensor) else tree


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return _copied(msd), _copied(osd["state"])


def save(rank: int, world: int, path: str, kind: str, plain_root: bool = False) -> tuple[dict, dict, float]:
    """Two steps, a sharded DCP checkpoint; (full model state, full optimizer state, next loss)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _build(kind, 0, plain_root)
    for step in range(2):
        _step(model, opt, step, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full = _full_state(model, opt)
    return (*full, _step(model, opt, 2, rank, world)[0].item())


def load(rank: int, world: int, path: str, kind: str, plain_root: bool = False) -> tuple[dict, dict, float]:
    """A model initialized otherwise loads the checkpoint; (full model state, full optimizer state,
    the loss of the step after)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build(kind, 7, plain_root)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    # torch's FSDP1 state holds ShardedTensors, which the default load planner's flattening turns
    # into a state dict without "optim.param_groups" (its own checkpoints fail to load too)
    planner = dcp.DefaultLoadPlanner(flatten_sharded_tensors=False) if kind == "torch" else None
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full_state(model, opt)
    return (*full, _step(model, opt, 2, rank, world)[0].item())


def broadcast_load(rank: int, world: int, full: tuple[dict, dict]) -> tuple[dict, dict]:
    """The full state on rank 0 only, loaded with ``broadcast_from_rank0=True``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = _build("fullshard", 7)
    _, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    msd = full[0] if rank == 0 else {}
    osd = {"state": full[1], "param_groups": osd["param_groups"]} if rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # (separate calls: torch's set_state_dict with {} on the other ranks hangs, torch's own FSDP too)
    set_model_state_dict(model, msd, options=options)
    set_optimizer_state_dict(model, opt, osd, options=options)
    return _full_state(model, opt)


def plain_root_load(rank: int, world: int) -> None:
    """``nn.Module.load_state_dict`` on a root that is no wrapper: each wrapper loads its part;
    missing and unexpected keys carry the original names."""
    theirs, _ = _build("torch", 0, plain_root=True)
    ours, _ = _build("fullshard", 7, plain_root=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = {k: v.clone() for k, v in theirs.state_dict().items()}
    assert not ours.load_state_dict(full).missing_keys
    _same(full, dict(ours.state_dict()), True, "loaded")
    broken = {k: v for k, v in full.items() if k != "1.lin.weight"} | {"1.extra": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1.lin.weight"'):
        ours.load_state_dict(broken)
    result = ours.load_state_dict(broken, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["1.lin.weight"], ["1.extra"]), result


def hybrid_rank0_only(rank: int, world: int) -> None:
    """HYBRID_SHARD over a (2, 2) mesh at 4 ranks: ``cpu_offload=True``
    full state lands on global rank 0 only, and ``broadcast_from_rank0`` loads it everywhere.
    torch's functions pass no group for a hybrid wrapper (the world's rank 0); the wrapper's
    shard group made ranks 0 and 2 "rank 0": both kept the state, and ranks 2 and 3 loaded rank
    2's {} (a TypeError there, the others waiting)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardingStrategy

    mesh = init_device_mesh("cpu", (2, world // 2))

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _wrap(
            "fullshard",
            make_stack(seed=seed, scale_shape=(1,)),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=mesh,
            use_orig_params=True,
        )
        return model, _opt("adamw", model.parameters())

    model, opt = build(0)
    for step in range(2):
        _step(model, opt, step, rank, world)
    full = _full_state(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        _same(full[0], msd, True, "cpu_offload full model state")
        _same(full[1], osd["state"], True, "cpu_offload full optimizer state")
    else:
        assert msd == {} and osd == {}, (rank, list(msd)[:3], list(osd))
    fresh, fresh_opt = build(7)
    _step(fresh, fresh_opt, 0, rank, world)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        set_model_state_dict(fresh, msd, options=options)
        set_optimizer_state_dict(fresh, fresh_opt, osd, options=options)
    loaded = _full_state(fresh, fresh_opt)
    _same(full[0], loaded[0], True, "model loaded from rank 0")
    _same(full[1], loaded[1], True, "optimizer loaded from rank 0")


def mixed(rank: int, world: int) -> str:
    """A model holding a torch FSDP1 wrapper and a fullshard one: refused by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    stack = make_stack(scale_shape=(1,))
    model = torch.nn.Sequential(_wrap("torch", stack.blocks[0]), _wrap("fullshard", stack.blocks[1]))
    with pytest.raises(ValueError, match="both fullshard's and torch's") as info:
        get_state_dict(model, _opt("adamw", model.parameters()))
    return str(info.value)


@pytest.mark.parametrize("plain_root", [False, True])
def test_full_state_is_torch_fsdp1s(tmp_path, plain_root: bool) -> None:
    """``get_state_dict(full_state_dict=True)``: whole tensors, torch FSDP1's bit for bit; also
    for a root that is no wrapper, and that model's checkpoint loads at 3 ranks."""
    theirs = run_ranks(save, 2, str(tmp_path / "torch"), "torch", plain_root)
    ours = run_ranks(save, 2, str(tmp_path / "fullshard"), "fullshard", plain_root)
    for rank in range(2):
        _same(theirs[rank][0], ours[rank][0], True, f"rank {rank} model")
        _same(theirs[rank][1], ours[rank][1], True, f"rank {rank} optimizer")
        assert ours[rank][2] == theirs[rank][2]
    if plain_root:
        for rank, got in enumerate(run_ranks(load, 3, str(tmp_path / "fullshard"), "fullshard", True)):
            _same(ours[0][0], got[0], True, f"rank {rank} model, loaded at 3")
            _same(ours[0][1], got[1], True, f"rank {rank} optimizer, loaded at 3")


@pytest.mark.parametrize(
    ("saver", "loader", "worlds"),
    [
        ("fullshard", "fullshard", (2, 3)),
        ("fullshard", "fullshard", (3, 2)),
        ("torch", "fullshard", (2, 3)),
        ("fullshard", "torch", (2, 2)),
        ("fullshard", "torch", (3, 2)),
    ],
)
def test_sharded_checkpoint_reshards(tmp_path, saver: str, loader: str, worlds: tuple[int, int]) -> None:
    """Saved at one world size, loaded at another: the saved state exactly, and the next step's
    loss (over the whole batch) is that of the saving run's next step (to float32 rounding: another world size adds in
    another order)."""
    path = str(tmp_path / "ckpt")
    saving = run_ranks(save, worlds[0], path, saver)
    loaded = run_ranks(load, worlds[1], path, loader)
    for rank, got in enumerate(loaded):
        _same(saving[0][0], got[0], True, f"{loader} rank {rank} model")
        _same(saving[0][1], got[1], True, f"{loader} rank {rank} optimizer")
    mean = [sum(r[2] for r in run) / len(run) for run in (saving, loaded)]  # equal shares: the batch's loss
    assert mean[1] == pytest.approx(mean[0], rel=1e-5)


def test_plain_root_loads_through_module_load_state_dict() -> None:
    run_ranks(plain_root_load, 2)


def test_hybrid_rank0_only_uses_the_world() -> None:
    run_ranks(hybrid_rank0_only, 4)


def test_broadcast_from_rank0_and_mixed_refused(tmp_path) -> None:
    saved = run_ranks(save, 2, str(tmp_path / "ckpt"), "fullshard")[0]
    for rank, got in enumerate(run_ranks(broadcast_load, 2, saved[:2])):
        _same(saved[0], got[0], True, f"rank {rank} model")
        _same(saved[1], got[1], True, f"rank {rank} optimizer")
    assert all("wrap it with one of them" in m for m in run_ranks(mixed, 2))
