"""fullshard's FullyShardedDataParallel against torch's own FSDP1, in the same process group.

Both wrap the same seeded ``Stack`` (``scale_shape=(1,)``: torch's FSDP1 refuses 0-dim
parameters) with one unit per ``Block``, take torch's option objects, and train on the same data.
Torch's FSDP1 runs on CPU with gloo only when given ``device_id=torch.device("cpu")``; without it
it raises "FSDP needs a non-CPU accelerator device". Compared, at 2 and 3 ranks:

- training: losses every step and the full parameters after it, per option (strategies,
  use_orig_params, mixed precision, prefetch settings, no_sync accumulation, ignored_modules,
  clip_grad_norm_), with SGD with momentum and with AdamW; and at 2 ranks a small CNN whose
  BatchNorm torch's default ``MixedPrecision._module_classes_to_ignore`` keeps in float32, in
  units of its own (losses, parameters and buffers bitwise, the number of units), and with ``()``;
- summon_full_params (values, writeback, with_grads, rank0_only) and where both raise;
- state dicts of the three types (keys, value types, local shapes, values) and the optimizer
  state dicts (``optim_state_dict``, ``full_optim_state_dict``), ``rank0_only`` included;
- checkpoints written by one loaded into the other (full state dicts, the legacy full optimizer
  state, and torch.distributed.checkpoint's sharded save), in both directions, then two more
  steps that must match the writer's own.

Tolerance: at 2 ranks the two are bitwise equal (same chunks, same order of addition) except
after ``clip_grad_norm_``: fullshard sums the partial norms in float64 by design, so the norm and
the clipped values differ from torch's in the last bits. At 3 ranks a sum of three gradients
depends on the order of addition (gloo's reduce-scatter under torch, fullshard's all-to-all and
local sum), so float32 values agree to rounding; the bfloat16 cases run at 2 ranks only (one
bf16 rounding apart, Adam's normalization amplifies it past any useful tolerance).

Where they differ by design (fullshard's choices, see docs/api.md): sharded state dicts hold
DTensors, not torch's ShardedTensors (torch.distributed.checkpoint reads either); local state
dicts hold each parameter's dim-0 rows under its own name, not a FlatParameter; parameters keep
their original names (no ``_fsdp_wrapped_module.`` prefix). Torch's own quirks on CPU that the
comparison avoids: a full optimizer state dict of a ``use_orig_params=True`` model returns
``exp_avg_sq``'s values as ``exp_avg`` (so its optimizer state comes from ``use_orig_params=False``
models, which train identically), ``FullStateDictConfig(offload_to_cpu=True)`` crashes the
process, and ``CPUOffload(offload_params=True)`` and ``sync_module_states`` need an accelerator
(``test_torch_fsdp1_more.py`` lifts the latter's check to compare it).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import Block, ConvBlock, batch, images, local, make_cnn, make_stack
from torch import nn

F32, BF16 = torch.float32, torch.bfloat16


# ---------------------------------------------------------------------------- building
def _wrap(kind: str, module: nn.Module, **kw: Any) -> nn.Module:
    """``module`` wrapped by torch's FSDP1 (``kind`` "torch") or fullshard's, a unit per Block."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kw.update(auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))  # the same call for both
    with warnings.catch_warnings():  # torch's deprecations; fullshard's "is not used" for torch's defaults
        warnings.simplefilter("ignore")
        return _cls(kind)(module, **kw)


def _cls(kind: str) -> Any:
    if kind == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    from fullshard import FSDP

    return FSDP


def _opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int, clip: float | None = None, zero=True
):
    """One MSE step on this rank's share of ``batch(step, 12)``; (loss, clip's norm or None).
    ``zero=False``: keep the gradients accumulated before (under no_sync)."""
    x, y = batch(step, 12)
    if zero:
        opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world))
    loss.backward()
    norm = model.clip_grad_norm_(clip) if clip is not None else None
    opt.step()
    return loss.detach(), norm


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict (both default to FULL_STATE_DICT on every rank), detached copies."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: Any, b: Any, exact: bool, what: str) -> None:
    """``a`` (torch's) equals ``b`` (fullshard's): bitwise when ``exact``, else to float32 rounding."""
    if isinstance(a, dict):  # in any order: torch's optimizer state lists the root unit's parameters first
        assert sorted(a, key=str) == sorted(b, key=str), f"{what}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], exact, f"{what}[{k!r}]")
        return
    if not isinstance(a, torch.Tensor):
        assert a == b, f"{what}: {a!r} != {b!r}"
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    if exact:
        assert torch.equal(a, b), f"{what}: max |diff| {(a.float() - b.float()).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------- training
def _training_cases(world: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, optimizer, wrapper arguments); the bf16 ones at 2 ranks only (see the module docstring)."""
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy

    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("full_shard sgd", "sgd", {}),
        ("full_shard adamw", "adamw", {}),
        ("shard_grad_op adamw", "adamw", {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}),
        ("no_shard sgd", "sgd", {"sharding_strategy": ShardingStrategy.NO_SHARD}),
        ("use_orig_params=False adamw", "adamw", {"use_orig_params": False}),
        (
            "backward_post forward_prefetch limit_all_gathers=False sgd",
            "sgd",
            {"backward_prefetch": BackwardPrefetch.BACKWARD_POST, "forward_prefetch": True, "limit_all_gathers": False},
        ),
        ("no backward_prefetch sgd", "sgd", {"backward_prefetch": None}),
        ("no_sync sgd", "sgd", {"_no_sync": True}),
        ("ignored_modules sgd", "sgd", {"_ignore": True}),
        ("ignored_states parameters adamw", "adamw", {"_ignore": "params"}),
        ("clip_grad_norm_ sgd", "sgd", {"_clip": 0.05}),
    ]
    if world == 2:
        low_grads = MixedPrecision(BF16, BF16, keep_low_precision_grads=True, cast_forward_inputs=True)
        cases += [
            ("bf16 all adamw", "adamw", {"mixed_precision": MixedPrecision(BF16, BF16, BF16)}),
            ("bf16 reduce only adamw", "adamw", {"mixed_precision": MixedPrecision(reduce_dtype=BF16)}),
            ("fp16 params fp32 reduce sgd", "sgd", {"mixed_precision": MixedPrecision(torch.float16, F32)}),
            ("bf16 keep_low_precision_grads cast_forward_inputs sgd", "sgd", {"mixed_precision": low_grads}),
            ("bf16 clip adamw", "adamw", {"mixed_precision": MixedPrecision(BF16), "_clip": 0.05}),
        ]
    return cases


def _train(kind: str, optim: str, kw: dict[str, Any], rank: int, world: int) -> tuple[list, list, dict, set]:
    """Three steps of ``kind``'s wrapper; (losses, clip norms, full state dict, gradient dtypes)."""
    kw = dict(kw)
    no_sync, ignore, clip = kw.pop("_no_sync", False), kw.pop("_ignore", False), kw.pop("_clip", None)
    kw.setdefault("use_orig_params", True)
    module = make_stack(scale_shape=(1,))
    if ignore == "params":  # one in a Block's unit, one in the root's: whole, never reduced
        kw["ignored_states"] = [module.blocks[1].lin.weight, module.head.bias]
    elif ignore:
        kw["ignored_modules"] = [module.blocks[1]]
    model = _wrap(kind, module, **kw)
    opt = _opt(optim, model.parameters())
    losses, norms = [], []
    for step in range(3):
        if no_sync:  # two micro-batches accumulated without communication, then one synced
            opt.zero_grad()
            with model.no_sync():
                for micro in (10, 11):
                    x, y = batch(10 * step + micro, 12)
                    torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()
        loss, norm = _step(model, opt, step, rank, world, clip, zero=not no_sync)
        losses.append(loss)
        norms.append(norm)
    # a set: torch leaves .grad None on a parameter with no rows on this rank, fullshard gives it a (0, ...) one
    grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    return losses, norms, _full(model), grad_dtypes


def _training(rank: int, world: int, done: list[str]) -> None:
    for name, optim, kw in _training_cases(world):
        theirs, ours = (_train(kind, optim, kw, rank, world) for kind in ("torch", "fullshard"))
        clip = "_clip" in kw
        exact = world == 2 and not clip
        for step, (a, b) in enumerate(zip(theirs[0], ours[0])):
            _same(a, b, exact, f"{name}: loss of step {step}")
        if clip:  # float64 partial norms (fullshard) against torch's float32 sum
            for a, b in zip(theirs[1], ours[1]):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=0, msg=lambda m, name=name: f"{name}: norm: {m}")
        _same(theirs[2], ours[2], exact, f"{name}: parameters")
        assert theirs[3] == ours[3], f"{name}: gradient dtypes {theirs[3]} != {ours[3]}"
        done.append(name)


# ---------------------------------------------------------------------------- summon_full_params
def _summon(rank: int, world: int, done: list[str]) -> None:
    """Full values inside the context, shown through the Parameter objects registered before
    it (torch's with use_orig_params=True), writeback of changes to the root's and a nested
    unit's parameters, with_grads, rank0_only, training after it; the misuse both refuse."""
    exact = world == 2
    pairs = {}
    for kind in ("torch", "fullshard"):
        model = _wrap(kind, make_stack(scale_shape=(1,)), use_orig_params=True)
        opt = _opt("sgd", model.parameters())
        _step(model, opt, 0, rank, world)
        pairs[kind] = model
    seen: dict[str, Any] = {}
    for kind, model in pairs.items():
        summon = _cls(kind).summon_full_params
        before = list(model.parameters())
        with summon(model, with_grads=True):
            assert [id(p) for p in model.parameters()] == [id(p) for p in before], kind
            assert before[1].shape == (13, 6), (kind, before[1].shape)  # stem.weight, in full
            seen[kind] = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
            with torch.no_grad():
                model.module.stem.weight.mul_(2.0)
                model.module.blocks[0].module.lin.weight.add_(1.0)
        with summon(model, rank0_only=True, writeback=False):
            seen[kind + " rank0_only"] = [p.detach().clone() for p in model.parameters()] if rank == 0 else []
        with pytest.raises((NotImplementedError, ValueError), match="rank0_only"):
            with summon(model, rank0_only=True, writeback=True):  # torch: NotImplementedError; fullshard: ValueError
                pass
    assert len(seen["torch"]) == len(seen["fullshard"])
    for i, ((p, g), (q, h)) in enumerate(zip(seen["torch"], seen["fullshard"])):
        _same(p, q, exact, f"summon parameter {i}")
        _same(g, h, exact, f"summon with_grads gradient {i}")
    for i, (p, q) in enumerate(zip(seen["torch rank0_only"], seen["fullshard rank0_only"])):
        _same(p, q, exact, f"summon rank0_only parameter {i}")
    _same(_full(pairs["torch"]), _full(pairs["fullshard"]), exact, "after summon writeback")
    losses = [_step(model, _opt("sgd", model.parameters()), 1, rank, world)[0] for model in pairs.values()]
    _same(losses[0], losses[1], exact, "loss after summon")
    _same(_full(pairs["torch"]), _full(pairs["fullshard"]), exact, "step after summon")
    for kind, model in pairs.items():
        with pytest.raises(RuntimeError, match="root"):
            model.module.blocks[0].clip_grad_norm_(1.0)
        with pytest.raises(RuntimeError, match="root"):
            with model.module.blocks[0].no_sync():
                pass
    done.append("summon_full_params")


# ---------------------------------------------------------------------------- state dicts
def _local_shard(value: Any) -> torch.Tensor:
    """This rank's rows of a ShardedTensor (torch's) or DTensor (fullshard's); empty if none."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    shards = value.local_shards()
    return shards[0].tensor if shards else torch.empty((0, *value.size()[1:]))


def _trained(kind: str, rank: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``kind``'s wrapper (torch's with use_orig_params=False: see the module docstring) after
    two AdamW steps."""
    model = _wrap(kind, make_stack(scale_shape=(1,)), use_orig_params=kind != "torch")
    opt = _opt("adamw", model.parameters())
    for step in range(2):
        _step(model, opt, step, rank, world)
    return model, opt


def _state_dicts(kind: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every state dict and optimizer state dict of ``model``, by type and config."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

    cls, out = _cls(kind), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cls.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            out["full"], out["full optim"] = model.state_dict(), cls.optim_state_dict(model, opt)
        r0 = (FullStateDictConfig(rank0_only=True), FullOptimStateDictConfig(rank0_only=True))
        with cls.state_dict_type(model, StateDictType.FULL_STATE_DICT, *r0):
            out["rank0_only"], out["rank0_only optim"] = model.state_dict(), cls.optim_state_dict(model, opt)
        with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            out["sharded"], out["sharded optim"] = model.state_dict(), cls.optim_state_dict(model, opt)
        with cls.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            out["local"] = model.state_dict()
        out["legacy full optim"] = cls.full_optim_state_dict(model, opt, rank0_only=False)
    return out


def _by_name(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with each group's parameter names sorted: torch's follow its
    optimizer's order, which for FlatParameters puts the root unit's first."""
    groups = [{**g, "params": sorted(g["params"])} for g in osd["param_groups"]]
    return {"state": osd["state"], "param_groups": groups}


def _compare_state_dicts(rank: int, world: int, done: list[str]) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    exact = world == 2
    theirs, ours = (_state_dicts(kind, *_trained(kind, rank, world)) for kind in ("torch", "fullshard"))
    assert list(theirs["full"]) == list(ours["full"])  # module order
    _same(theirs["full"], ours["full"], exact, "FULL_STATE_DICT")
    for key in ("full optim", "legacy full optim"):  # names, entries, values and param_groups
        _same(_by_name(theirs[key]), _by_name(ours[key]), exact, key)
    if rank == 0:
        _same(theirs["rank0_only"], ours["rank0_only"], exact, "rank0_only")
        _same(_by_name(theirs["rank0_only optim"]), _by_name(ours["rank0_only optim"]), exact, "rank0_only optim")
    else:  # both give the other ranks empty dicts
        for key in ("rank0_only", "rank0_only optim"):
            assert theirs[key] == {} and ours[key] == {}, (key, list(theirs[key]), list(ours[key]))
    # SHARDED: the same keys and dim-0 chunks; torch's values are ShardedTensors, fullshard's DTensors.
    assert list(theirs["sharded"]) == list(ours["sharded"])
    sharded = [(f"sharded {k}", v, ours["sharded"][k]) for k, v in theirs["sharded"].items()]
    osd_t, osd_o = theirs["sharded optim"], ours["sharded optim"]
    assert list(osd_t) == list(osd_o) and _by_name(osd_t)["param_groups"] == _by_name(osd_o)["param_groups"]
    assert sorted(osd_t["state"]) == sorted(osd_o["state"])
    for name, entry in osd_t["state"].items():
        assert sorted(entry) == sorted(osd_o["state"][name]), (name, list(entry), list(osd_o["state"][name]))
        for k, v in entry.items():
            if isinstance(v, ShardedTensor):
                sharded.append((f"sharded optim {name}.{k}", v, osd_o["state"][name][k]))
            else:
                _same(v, osd_o["state"][name][k], exact, f"sharded optim {name}.{k}")
    for what, a, b in sharded:
        assert isinstance(a, ShardedTensor) and isinstance(b, DTensor), (what, type(a), type(b))
        assert tuple(a.size()) == tuple(b.shape), (what, a.size(), b.shape)
        _same(_local_shard(a), _local_shard(b), exact, what)
    # LOCAL: torch's holds one FlatParameter per unit; fullshard's each parameter's rows by name.
    assert all(k.endswith("_flat_param") and isinstance(v, ShardedTensor) for k, v in theirs["local"].items())
    assert list(ours["local"]) == list(theirs["full"])
    for k, v in ours["local"].items():
        _same(_local_shard(theirs["sharded"][k]), v, exact, f"LOCAL_STATE_DICT {k}")
    done.append("state dicts")


# ---------------------------------------------------------------------------- cross-loading
def _fresh(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Another seed's model: whatever it trains like afterwards comes from the checkpoint."""
    model = _wrap(kind, make_stack(seed=7, scale_shape=(1,)), use_orig_params=kind != "torch")
    return model, _opt("adamw", model.parameters())


def _save(kind: str, model: nn.Module, opt: torch.optim.Optimizer, how: str, path: str) -> Any:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.fsdp import StateDictType

    cls = _cls(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "full":
            return model.state_dict(), cls.optim_state_dict(model, opt)
        if how == "legacy":
            return model.state_dict(), cls.full_optim_state_dict(model, opt, rank0_only=False)
        with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict(), "optim": cls.optim_state_dict(model, opt)}, checkpoint_id=path)
    return None


def _load(kind: str, model: nn.Module, opt: torch.optim.Optimizer, how: str, saved: Any, path: str) -> None:
    """Load as FSDP1 programs do: full dicts on every rank, or DCP with torch's optimizer helper."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import StateDictType

    cls = _cls(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "full":
            model.load_state_dict(saved[0])
            opt.load_state_dict(cls.optim_state_dict_to_load(model, opt, saved[1]))
        elif how == "legacy":
            model.load_state_dict(saved[0])
            opt.load_state_dict(cls.shard_full_optim_state_dict(saved[1], model))
        else:
            with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state = {"model": model.state_dict()}
                dcp.load(state, checkpoint_id=path)
                model.load_state_dict(state["model"])
                osd = load_sharded_optimizer_state_dict(state["model"], "optim", dcp.FileSystemReader(path))
                opt.load_state_dict(cls.optim_state_dict_to_load(model, opt, osd["optim"]))


def _cross_load(rank: int, world: int, path: str, done: list[str]) -> None:
    exact = world == 2
    for how in ("full", "legacy", "dcp"):
        for writer, reader in (("torch", "fullshard"), ("fullshard", "torch")):
            name = f"{how} {writer} -> {reader}"
            model, opt = _trained(writer, rank, world)
            where = os.path.join(path, name.replace(" ", "_").replace(">", ""))
            saved = _save(writer, model, opt, how, where)
            fresh, fresh_opt = _fresh(reader)
            _load(reader, fresh, fresh_opt, how, saved, where)
            for step in (2, 3):
                a, _ = _step(model, opt, step, rank, world)
                b, _ = _step(fresh, fresh_opt, step, rank, world)
                _same(a, b, exact, f"{name}: loss of step {step}")
            _same(_full(model), _full(fresh), exact, f"{name}: parameters")
            done.append(name)


# ---------------------------------------------------------------------------- BatchNorm in full precision
def _bn_cases() -> list[tuple[str, str, Any]]:
    """(name, optimizer, torch's MixedPrecision); the default ``_module_classes_to_ignore`` keeps
    BatchNorm in float32, in units of its own; ``()`` runs it in bfloat16 like every module."""
    from torch.distributed.fsdp import MixedPrecision

    bn_fp32 = MixedPrecision(BF16, BF16, BF16)
    bn_bf16 = MixedPrecision(BF16, BF16, BF16, _module_classes_to_ignore=())
    return [("bn fp32 sgd", "sgd", bn_fp32), ("bn fp32 adamw", "adamw", bn_fp32), ("bn bf16 adamw", "adamw", bn_bf16)]


def _train_cnn(kind: str, optim: str, mp: Any, rank: int, world: int) -> tuple[list, dict, dict, int, list[str]]:
    """Three steps of ``kind``'s wrapper of a SmallCNN, a unit per ConvBlock; (losses, full state
    dict, live buffer dtypes by name, number of units, fullshard's warnings naming the field)."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _cls(kind)(
            make_cnn(),
            auto_wrap_policy=ModuleWrapPolicy({ConvBlock}),
            mixed_precision=mp,
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    opt = _opt(optim, model.parameters())
    losses = []
    for step in range(3):
        x, y = images(step, 8)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    buffers = {n.replace("_fsdp_wrapped_module.", ""): b.dtype for n, b in model.named_buffers()}
    warned = [str(w.message) for w in caught if "_module_classes_to_ignore" in str(w.message)]
    return losses, _full(model), buffers, len(_cls(kind).fsdp_modules(model)), warned


def _batch_norm(rank: int, world: int, done: list[str]) -> None:
    """BatchNorm2d in the blocks' and BatchNorm1d in the root's: bitwise torch's (the same
    float32 BatchNorm, bfloat16 elsewhere); as many units as torch's FSDP instances."""
    for name, optim, mp in _bn_cases():
        theirs, ours = (_train_cnn(kind, optim, mp, rank, world) for kind in ("torch", "fullshard"))
        for step, (a, b) in enumerate(zip(theirs[0], ours[0])):
            _same(a, b, True, f"{name}: loss of step {step}")
        _same(theirs[1], ours[1], True, f"{name}: parameters and buffers")
        assert theirs[2] == ours[2], f"{name}: live buffer dtypes {theirs[2]} != {ours[2]}"
        assert theirs[3] == ours[3] == (6 if mp._module_classes_to_ignore else 3), (name, theirs[3], ours[3])
        kept = bool(mp._module_classes_to_ignore)
        assert ours[2]["norm.running_mean"] == (F32 if kept else BF16), ours[2]
        assert len(ours[4]) == kept and all("BatchNorm1d, BatchNorm2d" in w for w in ours[4]), ours[4]
        done.append(name)


# ---------------------------------------------------------------------------- the grid
def grid_body(rank: int, world: int, path: str) -> list[str]:
    done: list[str] = []
    _training(rank, world, done)
    if world == 2:  # bfloat16: at 2 ranks only (see the module docstring)
        _batch_norm(rank, world, done)
    _summon(rank, world, done)
    _compare_state_dicts(rank, world, done)
    _cross_load(rank, world, path, done)
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_against_torch_fsdp1(world: int, tmp_path: Any) -> None:
    results = run_ranks(grid_body, world, str(tmp_path), timeout=240)
    names = [n for n, _, _ in _training_cases(world)] + ([n for n, _, _ in _bn_cases()] if world == 2 else [])
    directions = (("torch", "fullshard"), ("fullshard", "torch"))
    crosses = [f"{how} {w} -> {r}" for how in ("full", "legacy", "dcp") for w, r in directions]
    expected = [*names, "summon_full_params", "state dicts", *crosses]
    assert all(r == expected for r in results), results  # every case ran on every rank
