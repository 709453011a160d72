"""More of fullshard's FullyShardedDataParallel against torch's own FSDP1, in one process group.

What ``test_torch_fsdp1.py`` leaves out, compared the same way (its helpers, bitwise at 2 ranks,
to float32 rounding at 3, where the order of addition differs):

- initialization: a model built on the meta device and materialized by each unit with its
  modules' ``reset_parameters()`` or a ``param_init_fn`` (both breadth first over a unit's
  modules, so seeded values agree); Accelerate's low-memory loading (rank 0 holds the weights,
  the others build on meta, ``param_init_fn=to_empty`` and ``sync_module_states=True``);
  ``sync_module_states`` over ranks seeded differently. Torch's FSDP1 refuses
  ``sync_module_states`` with CPU tensors ("requires them to be on GPU"); the comparison lifts
  that check (gloo broadcasts CPU tensors) to compare what it does;
- frozen parameters: some of a unit's, and a whole unit's, with ``use_orig_params=True``; with
  ``False`` torch refuses a unit that mixes them and fullshard trains it as with ``True``;
- tied parameters within the root unit (an embedding and a head) and within one nested unit;
  between two units (torch's forward fails: the second unit sees the first's shard);
- manual nested wrapping, alone and mixed with an ``auto_wrap_policy`` (torch refuses the mix;
  fullshard keeps the user's units and wraps the rest: it trains as torch's all-manual tree);
- ``fsdp_modules(root_only=True)``, ``.module``, ``named_buffers()``, ``apply``, ``to``,
  ``state_dict(prefix=)``, ``load_state_dict(strict=False)``'s missing and unexpected keys, a strict
  load's error message, each wrapper's ``process_group`` under FULL_SHARD, NO_SHARD and SHARD_GRAD_OP;
- forward with keyword arguments, outputs holding dicts, dataclasses, None and tensors that need
  no gradient, a unit called twice in one forward, ``torch.no_grad()`` evaluation between steps.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import patched, run_ranks
from models import Block, batch, local, make_stack
from test_torch_fsdp1 import _cls, _full, _opt, _same, _wrap
from torch import nn
from torch.distributed.fsdp import ShardingStrategy

KINDS = ("torch", "fullshard")


# ---------------------------------------------------------------------------- models
class Inner(nn.Module):
    """Nested containers in one unit (breadth first differs from depth first) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(6, 7), nn.Linear(7, 6))
        self.c = nn.Linear(6, 6)
        self.register_buffer("shift", torch.zeros(6))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.shift.copy_(0.1 * torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.seq(x)) + self.shift


class Net(nn.Module):
    """Input (batch, 6), output (batch, 3); one unit per Block under ``_wrap``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(Inner(), nn.LayerNorm(6))
        self.blocks = nn.ModuleList([Block(6, 7), Block(7, 6)])
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class TiedLM(nn.Module):
    """A head tied to an embedding (both in the root unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.blocks = nn.ModuleList([Block(6, 6), Block(6, 6)])
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.emb.weight.t())[:, :6]
        for b in self.blocks:
            h = b(h)
        return self.head(h)[:, :3]


def _tied_in_unit() -> nn.Module:
    m = _seeded(Net)
    m.blocks[1].norm.weight = m.blocks[1].norm.bias  # tied inside one nested unit
    return m


def _tied_across() -> nn.Module:
    m = _seeded(TiedLM)
    m.blocks[1].lin.weight = m.blocks[0].lin.weight  # tied between two units
    return m


def _seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def _init_fn(m: nn.Module) -> None:
    """A param_init_fn as torch's docs write one."""
    m.to_empty(device="cpu", recurse=False)
    if callable(getattr(m, "reset_parameters", None)):
        m.reset_parameters()


# ---------------------------------------------------------------------------- running
def _train(model: nn.Module, rank: int, world: int, forward: Callable | None = None, eval_too: bool = False) -> list:
    """Three AdamW steps of the (trainable) parameters; the losses (and no_grad outputs)."""
    opt = _opt("adamw", [p for p in model.parameters() if p.requires_grad])
    seen = []
    for step in range(3):
        x, y = batch(step, 12)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss((forward or model)(local(x, rank, world)), local(y, rank, world))
        loss.backward()
        opt.step()
        seen.append(loss.detach())
        if eval_too:
            model.eval()
            with torch.no_grad():
                seen.append(model(local(x, rank, world)))
            model.train()
    return seen


def _run(kind: str, build: Callable[[], nn.Module], rank: int, world: int, **kw: Any) -> tuple[list, dict, list]:
    """(losses, full state dict, warnings) of ``kind``'s wrapper of ``build()``, or raises."""
    forward, eval_too = kw.pop("_forward", None), kw.pop("_eval", False)
    kw.setdefault("use_orig_params", True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _cls(kind)(build(), device_id=torch.device("cpu"), **_policy(kw))
    seen = _train(model, rank, world, forward and (lambda x: forward(model, x)), eval_too)
    return seen, _full(model), [str(w.message) for w in caught]


def _policy(kw: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if kw.pop("_manual", False):
        return kw
    return {"auto_wrap_policy": ModuleWrapPolicy({Block}), **kw}


def _compare(name: str, theirs: tuple, ours: tuple, world: int) -> None:
    exact = world == 2
    assert len(theirs[0]) == len(ours[0]), name
    for i, (a, b) in enumerate(zip(theirs[0], ours[0])):
        _same(a, b, exact, f"{name}: output {i}")
    _same(theirs[1], ours[1], exact, f"{name}: state dict")


def _both(name: str, build: Callable, rank: int, world: int, done: list[str], **kw: Any) -> tuple:
    theirs, ours = (_run(kind, build, rank, world, **dict(kw)) for kind in KINDS)
    _compare(name, theirs, ours, world)
    done.append(name)
    return theirs, ours


# ---------------------------------------------------------------------------- initialization
def _on_meta(build: Callable[[], nn.Module], real: bool = False) -> Callable[[], nn.Module]:
    """``build`` under the meta device (seeded for what follows), or for real if ``real``."""

    def make() -> nn.Module:
        if real:
            return _seeded(build)
        with torch.device("meta"):
            m = build()
        torch.manual_seed(42)  # what the units' initialization draws
        return m

    return make


def _initialization(rank: int, world: int, done: list[str]) -> None:
    from torch.distributed.fsdp import _init_utils

    _both("meta reset_parameters", _on_meta(Net), rank, world, done)
    _both("meta param_init_fn", _on_meta(Net), rank, world, done, param_init_fn=_init_fn)
    sync = {"sync_module_states": True}
    with patched(_init_utils, _check_module_states_for_sync_module_states=lambda states: None):  # CPU tensors
        _both("sync_module_states", lambda: _seeded(Net, seed=rank), rank, world, done, **sync)
        low_memory = _on_meta(Net, real=rank == 0)  # Accelerate's cpu_ram_efficient_loading
        accel = {**sync, "param_init_fn": lambda m: m.to_empty(device="cpu", recurse=False)}
        _, ours = _both("rank 0 loads, sync_module_states", low_memory, rank, world, done, **accel)
    assert not [w for w in ours[2] if "param_init_fn" in w], ours[2]  # needed on the other ranks


# ---------------------------------------------------------------------------- frozen and tied
def _frozen(part: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        m = make_stack(scale_shape=(1,))
        if part == "some":  # mixed in a nested unit and in the root's
            m.blocks[1].lin.weight.requires_grad_(False)
            m.stem.bias.requires_grad_(False)
        else:  # a whole nested unit, and the root's stem
            m.blocks[2].requires_grad_(False)
            m.stem.requires_grad_(False)
        return m

    return make


def _frozen_and_tied(rank: int, world: int, done: list[str]) -> None:
    theirs, ours = _both("frozen in a unit", _frozen("some"), rank, world, done)
    assert any("requires_grad=True and False" in w for w in theirs[2]), theirs[2]  # torch's gradient memory
    assert not [w for w in ours[2] if "requires_grad" in w], ours[2]  # none kept for frozen ones here
    _both("frozen units", _frozen("all"), rank, world, done)
    for part, match in (("some", "requires_grad=True and False"), ("all", "uniform `requires_grad`")):
        with pytest.raises(ValueError, match=match):
            _run("torch", _frozen(part), rank, world, use_orig_params=False)
        flat = _run("fullshard", _frozen(part), rank, world, use_orig_params=False)
        _compare(f"frozen ({part}) use_orig_params=False", _run("torch", _frozen(part), rank, world), flat, world)
        done.append(f"frozen ({part}) use_orig_params=False")
    for orig in (True, False):
        _both(f"tied in the root unit {orig}", lambda: _seeded(TiedLM), rank, world, done, use_orig_params=orig)
        _both(f"tied in a nested unit {orig}", _tied_in_unit, rank, world, done, use_orig_params=orig)
    with pytest.raises(RuntimeError, match="mat2 must be a matrix"):
        _run("torch", _tied_across, rank, world)  # the second unit computes with the first's shard
    _run("fullshard", _tied_across, rank, world)  # kept in the root unit (tested in test_frozen_and_tied)
    done.append("tied across units")


# ---------------------------------------------------------------------------- structure
def _manual(kind: str, auto: bool) -> Callable[[], nn.Module]:
    """A Stack with its stem and blocks wrapped by hand (all of them, or the stem and the first
    block when ``auto``: the policy is to wrap the others)."""

    def make() -> nn.Module:
        m = make_stack(scale_shape=(1,))
        wrap = _cls(kind)
        for name in ["stem", "0"] if auto else ["stem", "0", "1", "2", "3"]:
            owner, attr = (m, "stem") if name == "stem" else (m.blocks, name)
            setattr(owner, attr, wrap(getattr(owner, attr), device_id=torch.device("cpu"), use_orig_params=True))
        return m

    return make


def _structure(rank: int, world: int, done: list[str]) -> None:
    manual = [_run(kind, _manual(kind, auto=False), rank, world, _manual=True) for kind in KINDS]
    _compare("manual nesting", *manual, world)
    with pytest.raises(ValueError, match="already have FSDP applied"):
        _run("torch", _manual("torch", auto=True), rank, world)
    mixed = _run("fullshard", _manual("fullshard", auto=True), rank, world)  # the same units as all-manual
    _compare("manual and auto_wrap_policy", manual[0], mixed, world)
    done += ["manual nesting", "manual and auto_wrap_policy"]
    seen = [_inspect(kind) for kind in KINDS]
    assert seen[0] == seen[1], seen
    done.append("fsdp_modules, module, apply, to, buffers, state_dict(prefix), load_state_dict(strict=False)")


def _inspect(kind: str) -> list[Any]:
    """What a program reads off a wrapped Stack; asserts the module and root facts."""
    cls, m = _cls(kind), make_stack(scale_shape=(1,))
    model = _wrap(kind, m, use_orig_params=True)
    assert model.module is m and cls.fsdp_modules(model, root_only=True) == [model]
    assert type(m.blocks[0]).__name__ == "FullyShardedDataParallel" and type(m.blocks[0].module) is Block
    applied: list[str] = []
    assert model.apply(lambda x: applied.append(type(x).__name__)) is model and model.to(torch.float32) is model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = model.state_dict()
        prefixed = list(model.state_dict(prefix="model."))
        del state["stem.weight"]
        state["extra.weight"] = torch.zeros(1)
        result = model.load_state_dict(state, strict=False)
        state["blocks.0.lin.weight"] = state["blocks.0.lin.weight"][:1]
        with pytest.raises(RuntimeError) as strict_error:
            model.load_state_dict(state)
    groups = []  # the process_group each wrapper reports, by strategy (torch's: the group it was given)
    for strategy in ("FULL_SHARD", "NO_SHARD", "SHARD_GRAD_OP"):
        wrapped = _wrap(kind, make_stack(scale_shape=(1,)), sharding_strategy=getattr(ShardingStrategy, strategy))
        groups.append(
            (
                strategy,
                [
                    (type(w.process_group).__name__, dist.get_process_group_ranks(w.process_group))
                    for w in cls.fsdp_modules(wrapped)
                ],
            )
        )
    return [
        groups,
        len(cls.fsdp_modules(model)),
        applied,
        [n for n, _ in model.named_buffers()],
        prefixed,
        (result.missing_keys, result.unexpected_keys),
        # torch's message, word for word, but for the size mismatch's key: torch's names the inner
        # modules (…_fsdp_wrapped_module.lin.weight), fullshard's the state dict's key
        str(strict_error.value).replace("_fsdp_wrapped_module.", ""),
    ]


# ---------------------------------------------------------------------------- forward
@dataclasses.dataclass
class Output:
    y: torch.Tensor
    tag: str


class Many(nn.Module):
    """Keyword arguments in, a dict of a tensor, a dataclass, None, an int and a tensor that
    needs no gradient out."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = make_stack(scale_shape=(1,))
        self.blk = Block(3, 3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, extra: torch.Tensor | None = None) -> dict[str, Any]:
        y = self.stack(x) * scale
        y = y if extra is None else y + extra
        return {"y": self.blk(y), "out": Output(y, "tag"), "none": None, "n": 3, "detached": y.detach()}


class Twice(nn.Module):
    """One unit (``b``) called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.b, self.head = nn.Linear(6, 7), Block(7, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.b(self.stem(x))))


def _many_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x, scale=2.0, extra=None)
    assert out["none"] is None and out["n"] == 3 and out["out"].tag == "tag" and not out["detached"].requires_grad
    return out["y"] + 0.5 * out["out"].y


def _forward(rank: int, world: int, done: list[str]) -> None:
    _both("keyword arguments, non-tensor outputs", lambda: _seeded(Many), rank, world, done, _forward=_many_forward)
    _both("a unit called twice", lambda: _seeded(Twice), rank, world, done)
    _both("no_grad evaluation between steps", lambda: make_stack(scale_shape=(1,)), rank, world, done, _eval=True)


# ---------------------------------------------------------------------------- the grid
SECTIONS = (_initialization, _frozen_and_tied, _structure, _forward)


def more_body(rank: int, world: int) -> list[str]:
    done: list[str] = []
    for section in SECTIONS:
        section(rank, world, done)
    return done


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_more_against_torch_fsdp1(world: int) -> None:
    results = run_ranks(more_body, world, timeout=180)
    assert len(results[0]) == 19 and all(r == results[0] for r in results), results
