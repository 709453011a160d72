"""More of FSDP2's surface against torch's own ``fully_shard``, in the same process group.

A second audit's cases (the first's are in test_fsdp2_contract.py), each building one seeded
model twice, sharding it with torch's ``fully_shard`` and with fullshard's, and running both
the same way; at 2 ranks the parameters are compared bitwise after every step:

- the root frees its parameters after forward when ``reshard_after_forward`` is given explicitly
  or set later, keeps them under the default (torch >= 2.8); two roots in one model;
- ``reshard_after_forward`` as an int (1: keep, 2: the shard group's size), False on the root
  only, and ``set_reshard_after_forward`` toggled between steps;
- ``unshard(async_op=True)`` and ``handle.wait()`` by hand before forward, ``reshard()`` by hand
  (what the module registers in between is torch's: full ``nn.Parameter``s); ``handle.wait()``
  only after the step the gather was for (a no-op, as torch's);
- a custom forward and backward prefetch order, and ``set_post_optim_event`` with a CPU
  ``torch.Event`` (torch's waits for nothing; fullshard's asked CUDA for its current stream);
- buffers (persistent, not persistent, an int64 counter) under bf16 ``MixedPrecisionPolicy``:
  names, dtypes, devices and state-dict values; ``output_dtype`` and ``cast_forward_inputs``;
- an embedding tied to the output projection (both in the root), and a unit run twice in one
  forward;
- ``zero_grad(set_to_none=False)`` then SGD with momentum; ``optimizer.zero_grad()`` between
  micro-batches with gradient sync off;
- ``get_total_norm`` (2, inf, 1), ``clip_grads_with_norm_`` and ``clip_grad_norm_(foreach=True,
  error_if_nonfinite=True)`` with an inf gradient on one rank;
- ``get_state_dict`` / ``set_state_dict`` with ``flatten_optimizer_state_dict``, and a full state
  dict saved at 2 ranks loaded at 3 with ``broadcast_from_rank0``; a state dict taken and loaded
  with units kept gathered between steps; a DCP save after a freeze, resumed into fresh models;
- parameters frozen and unfrozen between steps (``requires_grad_`` after sharding: a whole
  unit, part of the root, part of a unit), at 2 and 3 ranks, in units kept gathered across
  steps, while an earlier forward's output is kept (a backward through it is refused), and
  between micro-batches with gradient sync off (a freeze; an unfreeze is refused); ranks that
  change different parameters raise; the FSDP1 wrapper refuses it between no_sync micro-batches.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from dist import run_ranks
from models import TinyLM, tokens
from torch import nn


def _impls() -> dict:
    import torch.distributed.fsdp as tf

    import fullshard as fs

    return {"torch": tf, "fullshard": fs}


def _toks(step: int, rank: int, world: int, per: int = 2) -> torch.Tensor:
    return tokens(step, per * world)[rank * per : (rank + 1) * per]


def _shard(model: nn.Module, mod, root_kw: dict | None = None, **kw) -> nn.Module:
    for layer in model.layers:
        mod.fully_shard(layer, **kw)
    mod.fully_shard(model, **(kw if root_kw is None else root_kw))
    return model


def _pair(build=lambda: TinyLM(layers=3), **kw) -> list[nn.Module]:
    """(torch-sharded, fullshard-sharded) copies of one seeded model."""
    torch.manual_seed(0)
    base = build()
    return [_shard(copy.deepcopy(base), mod, **kw) for mod in _impls().values()]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _same(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), (name2, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert name == name2 and type(p) is type(q) and p.shape == q.shape, (what, name, type(q), q.shape)
        assert torch.equal(_local(p), _local(q)), f"{what}: {name}"


def _step(model: nn.Module, opt, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _adamw(*models: nn.Module) -> list:
    return [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]


def _registered(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(type(p).__name__, tuple(p.shape)) for p in model.parameters()]


def _reshard_after_forward(rank: int, world: int) -> None:
    root_kept = {"root_kw": {"reshard_after_forward": False}}
    for kw in ({"reshard_after_forward": 1}, {"reshard_after_forward": 2}, root_kept):
        ref, ours = _pair(**kw)
        opts = _adamw(ref, ours)
        for step, flag in enumerate((None, False, True)):
            for model in (ref, ours):
                if flag is not None:
                    model.set_reshard_after_forward(flag)
            losses = [_step(m, o, _toks(step, rank, world)) for m, o in zip((ref, ours), opts)]
            assert torch.equal(*losses), (kw, step)
            _same(ref, ours, f"{kw} step {step}")


def _sharded_after_forward(model: nn.Module, x: torch.Tensor, probe) -> tuple[bool, torch.Tensor]:
    """Forward, whether ``probe(model)`` (a root parameter) is a DTensor before backward, then
    the rest of the step's backward; (that answer, the loss)."""
    from torch.distributed.tensor import DTensor

    loss = model(x).logsumexp(-1).mean()
    sharded = isinstance(probe(model), DTensor)
    loss.backward()
    return sharded, loss.detach()


def _root_reshards_when_asked(rank: int, world: int) -> None:
    """The root keeps its full parameters into backward under the default (None), frees them
    when ``reshard_after_forward`` is given explicitly or set later (torch >= 2.8); also a model
    of two roots run one after the other (the first is freed after its forward)."""
    emb = lambda m: m.emb.weight  # noqa: E731
    for root_kw, later, want in (({}, None, False), ({"reshard_after_forward": True}, None, True), ({}, True, True)):
        ref, ours = _pair(build=lambda: _Tied(False), root_kw=root_kw)
        opts = _adamw(ref, ours)
        if later is not None:
            ref.set_reshard_after_forward(later, recurse=False)
            ours.set_reshard_after_forward(later, recurse=False)
        for step in range(2):
            got = [_sharded_after_forward(m, _toks(step, rank, world), emb) for m in (ref, ours)]
            assert [g[0] for g in got] == [want, want], (root_kw, later, got)
            assert torch.equal(got[0][1], got[1][1]), (root_kw, later, step)
            for o in opts:
                o.step()
                o.zero_grad()
            _same(ref, ours, f"root {root_kw} {later} step {step}")
    for mod in (_impls()["torch"], _impls()["fullshard"]):
        with pytest.raises(ValueError, match="reshard_after_forward should be a bool"):
            mod.fully_shard(nn.Linear(2, 2)).set_reshard_after_forward(1)
    seen = []
    for mod in _impls().values():
        torch.manual_seed(0)
        first, second = nn.Sequential(nn.Embedding(37, 12), nn.Linear(12, 12)), nn.Linear(12, 37)
        mod.fully_shard(first, reshard_after_forward=True)
        mod.fully_shard(second, reshard_after_forward=True)
        two = nn.Sequential(first, second)  # not sharded itself: two roots
        seen.append(_sharded_after_forward(two, _toks(0, rank, world), lambda m: m[0][0].weight))
    assert seen[0][0] and seen[1][0] and torch.equal(seen[0][1], seen[1][1]), seen


def _by_hand(rank: int, world: int) -> None:
    """Every unit gathered by hand (async) before forward, the blocks resharded by hand."""
    ref, ours = _pair()
    opts = _adamw(ref, ours)
    for step in range(2):
        seen = []
        for model, opt in zip((ref, ours), opts):
            handles = [layer.unshard(async_op=True) for layer in model.layers] + [model.unshard(async_op=True)]
            for h in handles:
                h.wait()
            gathered = _registered(model.layers[0])
            for layer in model.layers:
                layer.reshard()
            seen.append((gathered, _registered(model.layers[0])))
            _step(model, opt, _toks(step, rank, world))
        assert seen[0] == seen[1], seen
        assert seen[0][0][0][0] == "Parameter" and seen[0][1][0][0] == "DTensor", seen[0]
        _same(ref, ours, f"by hand {step}")
    for step in range(2, 4):  # waited for only after the step they were started for: a no-op then
        for model, opt in zip((ref, ours), opts):
            handles = [layer.unshard(async_op=True) for layer in model.layers] + [model.unshard(async_op=True)]
            _step(model, opt, _toks(step, rank, world))
            for h in handles:
                h.wait()
        assert [type(p).__name__ for p in ours.parameters()] == [type(p).__name__ for p in ref.parameters()]
        _same(ref, ours, f"waited after the step {step}")


def _prefetch_and_post_optim_event(rank: int, world: int) -> None:
    ref, ours = _pair(build=lambda: TinyLM(layers=4))
    for model in (ref, ours):
        layers = list(model.layers)
        layers[0].set_modules_to_forward_prefetch([layers[3], layers[1]])
        layers[3].set_modules_to_backward_prefetch([layers[1], layers[2]])
        layers[1].set_modules_to_backward_prefetch([layers[0]])
        layers[2].set_modules_to_backward_prefetch([])
    opts = _adamw(ref, ours)
    for step in range(2):
        for model, opt in zip((ref, ours), opts):
            _step(model, opt, _toks(step, rank, world))
            model.set_post_optim_event(torch.Event("cpu"))  # torch's CPU events cannot record
        _same(ref, ours, f"prefetch {step}")


class _BufLM(TinyLM):
    """TinyLM with a persistent and a non-persistent buffer per block and an int64 counter."""

    def __init__(self) -> None:
        super().__init__(layers=2)
        for i, layer in enumerate(self.layers):
            layer.register_buffer("scale", torch.full((12,), 1.0 + i))
            layer.register_buffer("tmp", torch.arange(12.0), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(t) + self.pos_embeddings(torch.arange(t.shape[1]))
        for layer in self.layers:
            h = layer(h) * layer.scale + layer.tmp * 1e-3
        self.steps += 1
        return self.output(self.norm(h.to(self.norm.weight.dtype))).float()


def _buffers_and_mixed_precision(rank: int, world: int) -> None:
    seen: dict[str, list] = {}
    for name, mod in _impls().items():
        bf16 = mod.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch.manual_seed(0)
        model = _shard(_BufLM(), mod, mp_policy=bf16)
        y = model(_toks(0, rank, world))
        buffers = [(n, b.dtype, b.device.type, type(b)) for n, b in model.named_buffers()]
        seen[name] = [y.dtype, buffers, model.state_dict()]
        # output_dtype and cast_forward_inputs on the blocks (the root casts to bf16)
        for output_dtype, cast in ((torch.float64, True), (torch.bfloat16, True), (None, False)):
            torch.manual_seed(0)
            model, inputs, outputs = _BufLM(), [], []
            policy = mod.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32,
                output_dtype=output_dtype,
                cast_forward_inputs=cast,
            )
            for layer in model.layers:
                mod.fully_shard(layer, mp_policy=policy)
                layer.register_forward_pre_hook(lambda _m, a: inputs.append(a[0].dtype))
                layer.register_forward_hook(lambda _m, _a, o: outputs.append(o.dtype))
            mod.fully_shard(model, mp_policy=bf16)
            try:
                y = model(_toks(0, rank, world))
                y.sum().backward()
                grads = [p.grad.dtype for p in model.parameters()]
                seen[name].append((inputs, outputs, y.dtype, grads))
            except RuntimeError as e:  # a float64 block output meets the bf16 norm
                seen[name].append(str(e)[:60])
    ref, ours = seen["torch"], seen["fullshard"]
    assert ref[:2] == ours[:2] and ref[3:] == ours[3:], (ref, ours)
    assert ref[2].keys() == ours[2].keys()
    assert all(torch.equal(v, ours[2][k]) for k, v in ref[2].items())


class _Tied(nn.Module):
    """An embedding tied to the output projection (both in the root's unit); ``reuse`` runs the
    first block's unit twice in one forward."""

    def __init__(self, reuse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 12)
        self.layers = nn.ModuleList([nn.Linear(12, 12) for _ in range(2)])
        self.out = nn.Linear(12, 37, bias=False)
        self.out.weight = self.emb.weight
        self.reuse = reuse

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.emb(t)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if self.reuse:
            h = torch.tanh(self.layers[0](h))
        return self.out(h)


def _tied_and_reused(rank: int, world: int) -> None:
    for reuse in (False, True):
        ref, ours = _pair(build=lambda: _Tied(reuse))
        assert ours.out.weight is ours.emb.weight and ref.state_dict().keys() == ours.state_dict().keys()
        opts = _adamw(ref, ours)
        for step in range(3):
            losses = [_step(m, o, _toks(step, rank, world)) for m, o in zip((ref, ours), opts)]
            assert torch.equal(*losses), (reuse, step)
            _same(ref, ours, f"tied, reuse={reuse}, step {step}")


def _zero_grad(rank: int, world: int) -> None:
    ref, ours = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ours)]
    for step in range(3):
        for model, opt in zip((ref, ours), opts):
            model(_toks(step, rank, world)).logsumexp(-1).mean().backward()
            opt.step()
            model.zero_grad(set_to_none=False)
        _same(ref, ours, f"zero_grad(set_to_none=False) {step}")
        for p, q in zip(ref.parameters(), ours.parameters()):
            assert type(p.grad) is type(q.grad) and torch.equal(_local(p.grad), _local(q.grad))
    ref, ours = _pair()  # optimizer.zero_grad() between micro-batches with gradient sync off
    for model, opt in zip((ref, ours), _adamw(ref, ours)):
        model.set_requires_gradient_sync(False)
        model(_toks(0, rank, world)).logsumexp(-1).mean().backward()
        opt.zero_grad()
        model(_toks(1, rank, world)).logsumexp(-1).mean().backward()
        model.set_requires_gradient_sync(True)
        _step(model, opt, _toks(2, rank, world))
    _same(ref, ours, "zero_grad between micro-batches")


def _norms(rank: int, world: int) -> None:
    from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm

    ref, ours = _pair()
    for model in (ref, ours):
        model(_toks(0, rank, world)).logsumexp(-1).mean().backward()
    for norm_type in (2.0, float("inf"), 1.0):
        a, b = (get_total_norm([p.grad for p in m.parameters()], norm_type, foreach=True) for m in (ref, ours))
        assert type(a) is type(b) and torch.equal(_local(a), _local(b)), (norm_type, a, b)
    for model in (ref, ours):
        clip_grads_with_norm_(list(model.parameters()), 0.5, get_total_norm([p.grad for p in model.parameters()]))
    assert all(torch.equal(_local(p.grad), _local(q.grad)) for p, q in zip(ref.parameters(), ours.parameters()))
    errors = []
    for model in (ref, ours):
        if rank == 0:
            _local(next(model.parameters()).grad)[0].fill_(float("inf"))
        with pytest.raises(RuntimeError, match="non-finite") as info:
            clip_grad_norm_(model.parameters(), 1.0, foreach=True, error_if_nonfinite=True)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def _eq(a, b, what: str) -> None:
    """Nested state dicts equal: keys, types (a list is a tuple), placements, values bitwise."""
    from torch.distributed.tensor import DTensor

    assert type(a) is type(b) or {type(a), type(b)} == {list, tuple}, (what, type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (what, list(a)[:5], list(b)[:5])
        for k in a:
            _eq(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _eq(x, y, f"{what}[{i}]")
    elif isinstance(a, DTensor):
        assert a.placements == b.placements and torch.equal(a.to_local(), b.to_local()), what
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    else:
        assert a == b, (what, a, b)


def _flattened_optimizer_state(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    full = StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=True, cpu_offload=True)
    ref, ours = _pair()
    opts = _adamw(ref, ours)
    for step in range(2):
        for model, opt in zip((ref, ours), opts):
            _step(model, opt, _toks(step, rank, world))
    for options in (flat, full):
        _eq(get_state_dict(ref, opts[0], options=options), get_state_dict(ours, opts[1], options=options), "flat")
    saved = get_state_dict(ours, opts[1], options=flat)
    fresh = _pair()
    fresh_opts = _adamw(*fresh)
    for model, opt in zip(fresh, fresh_opts):
        _step(model, opt, _toks(9, rank, world))  # optimizer state to be overwritten
        model_sd, optim_sd = copy.deepcopy(saved)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=flat)
    for model, opt in zip((ref, ours, *fresh), (*opts, *fresh_opts)):
        _step(model, opt, _toks(2, rank, world))
    for model in (ours, *fresh):
        _same(ref, model, "loaded flattened")
    model_sd, optim_sd = get_state_dict(ours, opts[1], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(tmp, "full.pt"))


def _load_full_at_another_world_size(rank: int, world: int, tmp: str) -> None:
    """torchtune's load: the full state dict on rank 0 only, broadcast into the shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = torch.load(os.path.join(tmp, "full.pt"), weights_only=False)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    models = _pair()
    for model, opt in zip(models, _adamw(*models)):
        _step(model, opt, _toks(9, rank, world))
        given = copy.deepcopy(saved) if rank == 0 else {"model": {}, "optim": {}}
        set_model_state_dict(model, given["model"], options=load)
        set_optimizer_state_dict(model, opt, given["optim"], options=load)
        got = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            _eq(list(got), [saved["model"], saved["optim"]], "loaded at 3")
        _step(model, opt, _toks(3, rank, world))
    for p, q in zip(*(m.parameters() for m in models)):  # 3 ranks: sums in another order
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=1e-5, atol=1e-6)


def _state_dict_of_units_kept_gathered(rank: int, world: int) -> None:
    """Units kept gathered between steps (``reshard_after_forward=False``,
    ``set_reshard_after_backward(False)``): taking or loading a state dict frees their full
    parameters, as torch's does, so the next forward gathers the shards' current values (after a
    load, the loaded ones; fullshard's forward used the full values gathered before the load)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ref, ours = _pair(reshard_after_forward=False)
    source = _pair()[1]
    _step(source, torch.optim.SGD(source.parameters(), lr=0.1), _toks(5, rank, world))
    for model in (ref, ours):
        model.set_reshard_after_backward(False)
    opts = _adamw(ref, ours)
    take = (
        lambda m: m.state_dict(),
        get_model_state_dict,
        lambda m: m.load_state_dict(source.state_dict()),
        lambda m: set_model_state_dict(m, get_model_state_dict(source)),
    )
    for step, change in enumerate(take):
        losses = [_step(m, o, _toks(step, rank, world)) for m, o in zip((ref, ours), opts)]
        assert torch.equal(*losses), step
        for model in (ref, ours):
            change(model)
    losses = [_step(m, o, _toks(4, rank, world)) for m, o in zip((ref, ours), opts)]
    assert torch.equal(*losses)
    for p, q in zip(*(o.param_groups[0]["params"] for o in opts), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def _freezing_then_resuming(rank: int, world: int, tmp: str) -> None:
    """A freeze between steps, a DCP sharded checkpoint after it, and a resume into fresh models
    (loaded, then frozen the same way; unfrozen a step later): the uninterrupted run's losses and
    parameters, and torch's, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def change(model: nn.Module, step: int) -> None:
        for name, p in model.named_parameters():
            if step in (1, 3) and name.startswith(("layers.0.", "tok_", "layers.1.w1.weight")):
                p.requires_grad_(step == 3)

    def run(models: list[nn.Module], opts: list, steps: range) -> list[list[torch.Tensor]]:
        losses = []
        for step in steps:
            for model in models:
                change(model, step)
            losses.append([_step(m, o, _toks(step, rank, world)) for m, o in zip(models, opts)])
        return losses

    models = _pair()
    opts = _adamw(*models)
    run(models, opts, range(2))
    for i, (model, opt) in enumerate(zip(models, opts)):
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=os.path.join(tmp, f"f{i}"))
    straight = run(models, opts, range(2, 5))
    resumed = _pair()
    resumed_opts = _adamw(*resumed)
    for i, (model, opt) in enumerate(zip(resumed, resumed_opts)):
        state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
        dcp.load(state, checkpoint_id=os.path.join(tmp, f"f{i}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        change(model, 1)
    again = run(resumed, resumed_opts, range(2, 5))
    for step, (a, b) in enumerate(zip(straight, again)):
        assert all(torch.equal(a[0], x) for x in (*a, *b)), step
    for model in (*models, resumed[0]):
        _same(model, resumed[1], "resumed after a freeze")


CASES_2 = (
    _reshard_after_forward,
    _root_reshards_when_asked,
    _by_hand,
    _prefetch_and_post_optim_event,
    _buffers_and_mixed_precision,
    _tied_and_reused,
    _zero_grad,
    _norms,
    _state_dict_of_units_kept_gathered,
)


# (step, name prefix, requires_grad): a whole unit, part of the root, part of a unit, all again
_FREEZING = [(1, "layers.0.", False), (2, "tok_embeddings.", False), (3, "layers.0.attention.", True), (4, "", True)]


def _freezing(rank: int, world: int) -> list[list[bool]]:
    """Parameters frozen and unfrozen between steps after sharding (``requires_grad_`` on the
    DTensor parameters), as torch's ``fully_shard`` allows: the same losses and parameters
    (bitwise at 2 ranks), the frozen ones without ``.grad``. Returns which parameters had a
    gradient at each step."""
    ref, ours = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, ours)]
    had_grad = []
    for step in range(6):
        for when, prefix, flag in _FREEZING:
            for model in (ref, ours) if when == step else ():
                for name, p in model.named_parameters():
                    if name.startswith(prefix):
                        p.requires_grad_(flag)
        losses, grads = [], []
        for model, opt in zip((ref, ours), opts):
            x = _toks(step, rank, world)
            loss = model(x).logsumexp(-1).mean()
            loss.backward()
            grads.append([p.grad is not None for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert grads[0] == grads[1], (step, grads)
        had_grad.append(grads[1])
        if world == 2:
            assert torch.equal(*losses), step
            _same(ref, ours, f"freezing, step {step}")
        else:
            torch.testing.assert_close(*losses)
    return had_grad


def _freezing_refused_by_the_wrapper(rank: int, world: int) -> None:
    """The FSDP1 wrapper lets parameters freeze between steps (test_several_roots.py compares it
    with torch's FSDP1) but not between no_sync micro-batches: refused at once there (fully_shard's
    freeze waits for the reduction)."""
    import fullshard as fs

    torch.manual_seed(0)
    model = fs.FSDP(TinyLM(layers=1), device_id=torch.device("cpu"), use_orig_params=True)
    with model.no_sync():
        model(_toks(0, rank, world)).sum().backward()
    next(model.parameters()).requires_grad_(False)
    with pytest.raises(RuntimeError, match="set to False after sharding while gradients accumulated without a red"):
        model(_toks(1, rank, world))


def _freezing_kept_gathered(rank: int, world: int) -> None:
    """Units never resharded (``reshard_after_forward=False``, ``set_reshard_after_backward(False)``),
    so their unshard has nothing to gather: a freeze between steps still reaches the layout (it
    was missed, and the frozen parameters kept training). As torch's, the kept full values are
    used (stale after the optimizer step)."""
    from torch.distributed.tensor import DTensor

    ref, ours = _pair(reshard_after_forward=False)
    for model in (ref, ours):
        model.set_reshard_after_backward(False)
    opts = _adamw(ref, ours)
    for step in range(3):
        for model in (ref, ours) if step == 1 else ():
            for p in model.layers[0].parameters():  # torch's: the kept unsharded ones
                p.requires_grad_(False)
        losses = [_step(m, o, _toks(step, rank, world)) for m, o in zip((ref, ours), opts)]
        assert torch.equal(*losses), step
        for p, q in zip(*(o.param_groups[0]["params"] for o in opts), strict=True):
            assert isinstance(q, DTensor) and torch.equal(p.full_tensor(), q.full_tensor()), step


def _freezing_with_a_kept_output(rank: int, world: int) -> None:
    """A freeze while an earlier forward's output is kept and never backwarded (its graph alive),
    which torch's allows: the next steps are torch's bit for bit. A backward through that kept
    output afterwards reads the old layout: fullshard refuses it, naming the unit (torch's runs
    it), and training goes on after ``zero_grad``."""
    ref, ours = _pair()
    opts = _adamw(ref, ours)
    for model, opt in zip((ref, ours), opts):
        _step(model, opt, _toks(0, rank, world))
    kept = [model(_toks(1, rank, world)) for model in (ref, ours)]
    for model in (ref, ours):
        model.layers[1].w1.weight.requires_grad_(False)
        model.layers[2].attention_norm.weight.requires_grad_(False)
    losses = [_step(m, o, _toks(2, rank, world)) for m, o in zip((ref, ours), opts)]
    assert torch.equal(*losses)
    with pytest.raises(RuntimeError, match="FSDP unit '.*': backward runs through a forward made before requires_grad"):
        kept[1].sum().backward()
    opts[1].zero_grad()
    del kept
    for step in (3, 4):
        losses = [_step(m, o, _toks(step, rank, world)) for m, o in zip((ref, ours), opts)]
        assert torch.equal(*losses), step
        _same(ref, ours, f"kept output, step {step}")


class _ReentrantLM(TinyLM):
    """TinyLM whose blocks run under reentrant activation checkpointing: their forward runs
    without grad, and again inside backward, where each block's pre-backward prefetches the
    block after it (which has reduced by then)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.tok_embeddings(ids) + self.pos_embeddings(torch.arange(ids.shape[1]))
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=True)
        return self.output(self.norm(h)).float()


def _unfreezing_with_a_kept_output(rank: int, world: int) -> None:
    """A whole unit frozen, run forward with its output kept, then unfrozen: no split tracks a
    unit without trainable parameters, and a backward through the kept output is refused with the
    error naming the unit (it was autograd's bare in-place error)."""
    import fullshard as fs

    torch.manual_seed(0)
    model = _shard(TinyLM(layers=3), fs)
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    kept = model(_toks(0, rank, world))
    for p in model.layers[0].parameters():
        p.requires_grad_(True)
    model(_toks(1, rank, world)).sum().backward()
    with pytest.raises(RuntimeError, match="FSDP unit 'layers.0': backward runs through a forward made before"):
        kept.sum().backward()


def _freezing_differently_on_each_rank(rank: int, world: int) -> None:
    """Each rank freezes a different parameter of the same size: the layouts would differ and
    the all-gather would hand one parameter's values to the other, silently. Every rank raises
    instead, naming the parameter (torch's does not check)."""
    import fullshard as fs

    torch.manual_seed(0)
    model = _shard(TinyLM(layers=3), fs)
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1), _toks(0, rank, world))
    block = model.layers[1]
    assert block.w1.weight.numel() == block.w2.weight.numel()
    (block.w1 if rank == 0 else block.w2).weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"FSDP unit 'layers.1': w1.weight.requires_grad was changed on some ranks"):
        model(_toks(1, rank, world))


def _freezing_between_micro_batches(rank: int, world: int, build=lambda: TinyLM(layers=3)) -> None:
    """Parameters frozen between two micro-batches, gradient sync off for the first (torch's
    allows it): what they accumulated is reduced with the rest, so they still get a ``.grad``
    and step, bitwise torch's; the unit is laid out again at the next step. Unfreezing there is
    refused (a frozen parameter has nowhere to accumulate), naming the parameter. With
    ``_ReentrantLM`` a block is gathered again in backward while its reduction is in flight:
    its layout must wait for that reduction too (it was changed under it)."""
    ref, ours = _pair(build)
    opts = _adamw(ref, ours)

    def micro_batches(model: nn.Module, opt, step: int, change=None) -> tuple[torch.Tensor, list[bool]]:
        x = _toks(step, rank, world, per=4)
        model.set_requires_gradient_sync(False)
        model(x[:2]).logsumexp(-1).mean().backward()
        model.set_requires_gradient_sync(True)
        if change is not None:
            change(model)
        loss = model(x[2:]).logsumexp(-1).mean()
        loss.backward()
        had = [p.grad is not None for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        return loss.detach(), had

    def freeze(model: nn.Module) -> None:
        model.layers[1].w1.weight.requires_grad_(False)
        model.tok_embeddings.weight.requires_grad_(False)
        for p in model.layers[2].parameters():
            p.requires_grad_(False)

    for step in range(4):
        (a, had_a), (b, had_b) = (
            micro_batches(m, o, step, freeze if step == 1 else None) for m, o in zip((ref, ours), opts)
        )
        assert torch.equal(a, b) and had_a == had_b, step
        assert all(had_b) if step < 2 else not all(had_b), step
        _same(ref, ours, f"frozen between micro-batches, step {step}")
    with pytest.raises(RuntimeError, match="w1.weight.requires_grad was set to True .* without a reduction"):
        micro_batches(ours, opts[1], 4, lambda m: m.layers[1].w1.weight.requires_grad_(True))


def freezing_body(rank: int, world: int) -> list[list[bool]]:
    _freezing_refused_by_the_wrapper(rank, world)
    if world == 2:
        _freezing_kept_gathered(rank, world)
        _freezing_with_a_kept_output(rank, world)
        _unfreezing_with_a_kept_output(rank, world)
        _freezing_differently_on_each_rank(rank, world)
        _freezing_between_micro_batches(rank, world)
        _freezing_between_micro_batches(rank, world, lambda: _ReentrantLM(layers=3))
    return _freezing(rank, world)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_requires_grad_changed_between_steps_like_torch(world: int) -> None:
    had_grad = run_ranks(freezing_body, world, timeout=150)[0]
    names = [n for n, _ in TinyLM(layers=3).named_parameters()]
    frozen_at = [[n for n, g in zip(names, step) if not g] for step in had_grad]
    assert frozen_at[0] == [] and frozen_at[5] == []
    assert frozen_at[1] == [n for n in names if n.startswith("layers.0.")]
    assert frozen_at[3] == [n for n in names if n.startswith(("layers.0.", "tok_")) and ".attention." not in n]


def body_2(rank: int, world: int, tmp: str) -> list[str]:
    done = []
    for case in CASES_2:
        case(rank, world)
        done.append(case.__name__)
    _flattened_optimizer_state(rank, world, tmp)
    _freezing_then_resuming(rank, world, tmp)
    return [*done, "flattened", "resumed"]


def body_3(rank: int, world: int, tmp: str) -> str:
    _load_full_at_another_world_size(rank, world, tmp)
    return "loaded"


@pytest.mark.timeout(200)
def test_more_of_fully_shard_like_torch_at_2_and_3_ranks(tmp_path) -> None:
    done = run_ranks(body_2, 2, str(tmp_path), timeout=150)[0]
    assert done == [c.__name__ for c in CASES_2] + ["flattened", "resumed"]
    assert run_ranks(body_3, 3, str(tmp_path), timeout=100)[0] == "loaded"
