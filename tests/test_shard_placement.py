"""``fully_shard(..., shard_placement_fn=...)`` returning ``Shard(dim)`` for a dim other than 0,
against torch's own ``fully_shard`` in the same process group.

Each case builds one seeded model twice, shards it with torch's ``fully_shard`` and with
fullshard's, and trains both the same way; at 2 ranks parameters and losses are compared
bitwise after every step, at 3 ranks (gloo sums three ranks' gradients in another order) to
float32 rounding:

- TinyLM with every 2-D weight ``Shard(1)`` (dims divisible by 2 and 3, as torch requires),
  ``reshard_after_forward`` True and False, AdamW: registered placements and local shapes,
  ``.grad`` placements, ``full_tensor()``, ``clip_grad_norm_``; gradient sync off for a
  micro-batch; bf16 ``param_dtype`` with float32 ``reduce_dtype``;
- a mixture-of-experts layer with 3-D weights, ``Shard(2)`` (given as ``Shard(-1)``) and ``Shard(1)``;
- uneven dims (13 and 7 columns at 2 and 3 ranks): torch's ``fully_shard`` refuses them
  ("does not support uneven sharding on dim 1"); fullshard chunks them as DTensor does
  (``torch.chunk``), and the model trains bitwise like torch's ``Shard(0)`` sharding of it;
- the DCP state-dict functions, full and sharded, model and optimizer: equal to torch's, and
  loaded back (``set_model_state_dict`` / ``set_optimizer_state_dict``) into fresh models;
- at 4 ranks, ``reshard_after_forward=2`` (bitwise like True; torch's fails there) and a 2-D
  (replicate, shard) mesh, placements ``(Replicate(), Shard(1))``;
- sharded on the meta device, then ``to_empty`` and ``load_state_dict`` of full tensors;
- a dim out of range is a ValueError naming the parameter and ``shard_placement_fn``; a
  placement other than ``Shard`` a NotImplementedError; a call that fails after reading
  ``shard_placement_fn`` leaves no dim behind for the next call.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import TinyLM, batch, local, make_stack, tokens
from torch import nn


def _impls() -> dict:
    import torch.distributed.fsdp as tf

    import fullshard as fs

    return {"torch": tf, "fullshard": fs}


def _cols(p: nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(1) if p.ndim == 2 else None


def _shard_lm(model: TinyLM, mod, fn=_cols, **kw) -> TinyLM:
    for layer in model.layers:
        mod.fully_shard(layer, shard_placement_fn=fn, **kw)
    mod.fully_shard(model, shard_placement_fn=fn, **kw)
    return model


def _lm_pair(**kw) -> list[nn.Module]:
    """(torch-sharded, fullshard-sharded) copies of one seeded TinyLM, 2-D weights Shard(1)."""
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    return [_shard_lm(copy.deepcopy(base), mod, **kw) for mod in _impls().values()]


def _toks(step: int, rank: int, world: int, per: int = 2) -> torch.Tensor:
    return tokens(step, per * world)[rank * per : (rank + 1) * per]


def _lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logsumexp(-1).mean()


def _same(a: nn.Module, b: nn.Module, what: str, exact: bool = True) -> None:
    """Same names, placements, local shapes and values (bitwise, or to float32 rounding)."""
    for (name, p), (name2, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert name == name2 and p.placements == q.placements, (what, name, p.placements, q.placements)
        assert p.to_local().shape == q.to_local().shape and q.to_local().is_contiguous(), (what, name)
        if exact:
            assert torch.equal(p.to_local(), q.to_local()), f"{what}: {name}"
        else:
            torch.testing.assert_close(q.to_local(), p.to_local(), rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def _check_grads(model: nn.Module, what: str) -> None:
    for name, p in model.named_parameters():
        g = p.grad
        assert g is not None and type(g) is type(p), (what, name, type(g))
        assert g.placements == p.placements and g.shape == p.shape, (what, name, g.placements, p.placements)
        assert g.to_local().shape == p.to_local().shape, (what, name)


def _train_lm(rank: int, world: int, exact: bool) -> None:
    from torch.distributed.tensor import Shard
    from torch.nn.utils import clip_grad_norm_

    for reshard in (True, False):
        ref, ours = _lm_pair(reshard_after_forward=reshard)
        what = f"reshard_after_forward={reshard}"
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            want = (Shard(1),) if p.ndim == 2 else (Shard(0),)
            assert p.placements == want == q.placements, (name, q.placements)
            assert torch.equal(p.full_tensor(), q.full_tensor()), (what, name)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
        for step in range(3):
            losses, norms = [], []
            for model, opt in zip((ref, ours), opts):
                loss = _lm_loss(model, _toks(step, rank, world))
                loss.backward()
                _check_grads(model, what)
                norms.append(clip_grad_norm_(model.parameters(), 1.0).full_tensor())
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            if exact:
                assert torch.equal(*losses) and torch.equal(*norms), (what, step, losses, norms)
            else:
                torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=1e-6)
            _same(ref, ours, f"{what} step {step}", exact)
        for p, q in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(
                q.full_tensor(), p.full_tensor(), rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6
            )


def _no_sync_and_mixed_precision(rank: int, world: int) -> None:
    """Gradients accumulated unsynced over a micro-batch, then bf16 compute with float32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ref, ours = _lm_pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for model, opt in zip((ref, ours), opts):
        model.set_requires_gradient_sync(False)
        _lm_loss(model, _toks(0, rank, world)).backward()
        model.set_requires_gradient_sync(True)
        _lm_loss(model, _toks(1, rank, world)).backward()
        _check_grads(model, "no_sync")
        opt.step()
    _same(ref, ours, "gradient sync off for a micro-batch")

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref, ours = _lm_pair(mp_policy=mp)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        losses = []
        for model, opt in zip((ref, ours), opts):
            loss = _lm_loss(model, _toks(step, rank, world))
            loss.backward()
            _check_grads(model, "bf16")
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(*losses), (step, losses)
        _same(ref, ours, f"bf16 step {step}")


class Experts(nn.Module):
    """A dense mixture of 4 experts with 3-D weights (experts, in, out) and (experts, out, in)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 12)
        self.w1 = nn.Parameter(torch.randn(4, 12, 6) / 4)
        self.w2 = nn.Parameter(torch.randn(4, 6, 12) / 4)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        y = torch.nn.functional.gelu(torch.einsum("bd,edh->beh", h, self.w1))
        return self.head(h + torch.einsum("beh,ehd->bd", y, self.w2))


def _expert_dims(p: nn.Parameter):
    from torch.distributed.tensor import Shard

    return {3: Shard(-1) if p.shape[-1] == 6 else Shard(1), 2: Shard(1)}.get(p.ndim)


def _experts(rank: int, world: int, exact: bool) -> None:
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    base = Experts()
    models = []
    for mod in _impls().values():
        model = copy.deepcopy(base)
        mod.fully_shard(model, shard_placement_fn=_expert_dims)
        models.append(model)
    ref, ours = models
    assert ours.w1.placements == (Shard(2),) and ours.w2.placements == (Shard(1),), (ours.w1.placements,)
    assert ours.w1.to_local().shape == (4, 12, 6 // world)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        x, y = batch(step, 4 * world)
        losses = []
        for model, opt in zip(models, opts):
            loss = torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world))
            loss.backward()
            _check_grads(model, "experts")
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if exact:
            assert torch.equal(*losses), (step, losses)
        _same(ref, ours, f"experts step {step}", exact)


def _uneven(rank: int, world: int, exact: bool) -> None:
    """Stack's 13- and 7-column weights Shard(1): chunked as torch.chunk, trained like torch's
    fully_shard with Shard(0) (which is all torch's accepts for them)."""
    import torch.distributed.fsdp as tf
    from torch.distributed.tensor import Shard

    import fullshard as fs

    with pytest.raises(NotImplementedError, match="uneven sharding on dim 1"):
        tf.fully_shard(make_stack(0, (1,)).blocks[0], shard_placement_fn=_cols)
    base = make_stack(0, (1,))
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    for block in ref.blocks:
        tf.fully_shard(block)
    tf.fully_shard(ref)
    for block in ours.blocks:
        fs.fully_shard(block, shard_placement_fn=_cols)
    fs.fully_shard(ours, shard_placement_fn=_cols)
    for (name, p), q in zip(base.named_parameters(), ours.parameters()):
        want = p.detach().chunk(world, dim=1 if p.ndim == 2 else 0)
        mine = want[rank] if rank < len(want) else p.detach().narrow(p.ndim - 1, 0, 0)
        assert q.placements == ((Shard(1),) if p.ndim == 2 else (Shard(0),)), (name, q.placements)
        assert q.to_local().shape == mine.shape and torch.equal(q.to_local(), mine), (name, q.to_local().shape)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        x, y = batch(step, 4 * world)
        losses = []
        for model, opt in zip((ref, ours), opts):
            loss = torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world))
            loss.backward()
            _check_grads(model, "uneven")
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if exact:
            assert torch.equal(*losses), (step, losses)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            a, b = p.full_tensor(), q.full_tensor()
            torch.testing.assert_close(b, a, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6, msg=name)


def _eq(a, b, what: str, placements: bool = True) -> None:
    """Nested state dicts equal: keys, types, DTensor placements and local values, bitwise."""
    from torch.distributed.tensor import DTensor

    assert type(a) is type(b) or {type(a), type(b)} == {list, tuple}, (what, type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (what, list(a)[:5], list(b)[:5])
        for k in a:
            _eq(a[k], b[k], f"{what}.{k}", placements)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _eq(x, y, f"{what}[{i}]", placements)
    elif isinstance(a, DTensor):
        if placements:
            assert a.placements == b.placements and torch.equal(a.to_local(), b.to_local()), what
        else:
            assert torch.equal(a.full_tensor(), b.full_tensor()), what
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    else:
        assert a == b, (what, a, b)


def _state_dicts(rank: int, world: int) -> None:
    """The DCP state-dict functions, full and sharded, against torch's; loaded back into fresh
    models, which then train like the originals."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ref, ours = _lm_pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(2):
        for model, opt in zip((ref, ours), opts):
            _lm_loss(model, _toks(step, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    for full in (False, True):
        options = StateDictOptions(full_state_dict=full)  # full: on every rank
        saved = []
        for model, opt in zip((ref, ours), opts):
            saved.append(
                (get_model_state_dict(model, options=options), get_optimizer_state_dict(model, opt, options=options))
            )
        _eq(saved[0], saved[1], f"full={full}")
        if full:
            w = saved[1][0]["layers.0.w1.weight"]
            assert type(w) is torch.Tensor and w.shape == (48, 12), (type(w), w.shape)
        fresh = _lm_pair()[1]
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        _lm_loss(fresh, _toks(9, rank, world)).backward()  # optimizer state to be overwritten
        fresh_opt.step()
        fresh_opt.zero_grad()
        model_sd, optim_sd = copy.deepcopy(saved[1])
        set_model_state_dict(fresh, model_sd, options=options)
        set_optimizer_state_dict(fresh, fresh_opt, optim_sd, options=options)
        _same(ours, fresh, f"loaded full={full}")
        _eq(get_optimizer_state_dict(fresh, fresh_opt, options=options), saved[1][1], f"optimizer loaded full={full}")
        for model, opt in ((ref, opts[0]), (fresh, fresh_opt)):
            _lm_loss(model, _toks(5, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        _same(ref, fresh, f"a step after loading full={full}")
        ours, opts[1] = fresh, fresh_opt


def _meta_init(rank: int, world: int) -> None:
    """Sharded on the meta device, ``to_empty``, then ``load_state_dict`` of full tensors (each
    rank takes its columns): trains like torch's model built eagerly."""
    import fullshard as fs

    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ref = _shard_lm(copy.deepcopy(base), _impls()["torch"])
    with torch.device("meta"):
        ours = _shard_lm(TinyLM(layers=2), fs)
    ours.to_empty(device="cpu")
    ours.load_state_dict(base.state_dict())
    _run([ref, ours], rank, world, "meta init", exact=True)


def _uneven_state_dicts(rank: int, world: int, step: bool) -> None:
    """Uneven Shard(1): full state dicts equal to torch's Shard(0) model's (after an Adam step
    when ``step``: at 2 ranks, where the sums are the same bits), loaded back."""
    import torch.distributed.fsdp as tf
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    import fullshard as fs

    full = StateDictOptions(full_state_dict=True)
    base = make_stack(0, (1,))
    ref, ours, fresh = (copy.deepcopy(base) for _ in range(3))
    tf.fully_shard(ref)
    fs.fully_shard(ours, shard_placement_fn=_cols)
    fs.fully_shard(fresh, shard_placement_fn=_cols)
    for model in (ref, ours) if step else ():
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = batch(0, 4 * world)
        torch.nn.functional.mse_loss(model(local(x, rank, world)), local(y, rank, world)).backward()
        opt.step()
    saved = get_model_state_dict(ours, options=full)
    _eq(get_model_state_dict(ref, options=full), saved, "uneven full")
    _eq(get_model_state_dict(ref), get_model_state_dict(ours), "uneven sharded", placements=False)
    set_model_state_dict(fresh, copy.deepcopy(saved), options=full)
    _same(ours, fresh, "uneven loaded")


def _errors(rank: int, world: int) -> None:
    from torch.distributed.tensor import Replicate, Shard

    import fullshard as fs

    with pytest.raises(ValueError, match=r"shard_placement_fn returned Shard\(dim=2\) for 'lin.weight'.*out of range"):
        fs.fully_shard(make_stack(0, (1,)).blocks[0], shard_placement_fn=lambda p: Shard(2))
    with pytest.raises(ValueError, match=r"'lin.bias'.*dim -2 is out of range"):
        fs.fully_shard(make_stack(0, (1,)).blocks[0], shard_placement_fn=lambda p: Shard(-2))
    with pytest.raises(NotImplementedError, match="return Shard"):
        fs.fully_shard(make_stack(0, (1,)).blocks[0], shard_placement_fn=lambda p: Replicate())
    block = fs.fully_shard(make_stack(0, (1,)).blocks[0], shard_placement_fn=lambda p: Shard(-1))
    assert block.lin.weight.placements == (Shard(1),) and block.lin.bias.placements == (Shard(0),)
    # A call that fails after reading shard_placement_fn (here reshard_after_forward=3 at 2 ranks)
    # leaves nothing behind: the next call without it shards along dim 0.
    block = make_stack(0, (1,)).blocks[0]
    with pytest.raises(ValueError, match="reshard_after_forward=3 must divide"):
        fs.fully_shard(block, shard_placement_fn=lambda p: Shard(-1), reshard_after_forward=3)
    fs.fully_shard(block)
    assert block.lin.weight.placements == (Shard(0),), block.lin.weight.placements


def body_2(rank: int, world: int) -> list[str]:
    _train_lm(rank, world, exact=True)
    _no_sync_and_mixed_precision(rank, world)
    _experts(rank, world, exact=True)
    _uneven(rank, world, exact=True)
    _state_dicts(rank, world)
    _uneven_state_dicts(rank, world, step=True)
    _meta_init(rank, world)
    _errors(rank, world)
    return ["done"]


def body_3(rank: int, world: int) -> list[str]:
    _train_lm(rank, world, exact=False)
    _experts(rank, world, exact=False)
    _uneven(rank, world, exact=False)
    _uneven_state_dicts(rank, world, step=False)
    return ["done"]


def _run(models: list[nn.Module], rank: int, world: int, what: str, exact: bool) -> None:
    """Three AdamW steps of each model; losses and parameters compared with the first's."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        losses = []
        for model, opt in zip(models, opts):
            loss = _lm_loss(model, _toks(step, rank, world))
            loss.backward()
            _check_grads(model, what)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        for other in models[1:]:
            _same(models[0], other, f"{what} step {step}", exact)


def _post_forward_and_hybrid(rank: int, world: int) -> None:
    """reshard_after_forward=2 of 4 ranks (torch 2.13's fails there with Shard(1): "setStorage
    ... out of bounds"): bitwise like fullshard's reshard_after_forward=True. A 2-D (replicate,
    shard) mesh: (Replicate(), Shard(1)) like torch's HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import fullshard as fs

    torch.manual_seed(0)
    base = TinyLM(layers=2)
    pair = [_shard_lm(copy.deepcopy(base), fs, reshard_after_forward=r) for r in (True, 2)]
    _run(pair, rank, world, "reshard_after_forward=2", exact=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hybrid = [_shard_lm(copy.deepcopy(base), mod, mesh=mesh) for mod in _impls().values()]
    assert hybrid[1].layers[0].w1.weight.placements == (Replicate(), Shard(1))
    _run(hybrid, rank, world, "hybrid", exact=False)  # 4 ranks: sums in another order


@pytest.mark.timeout(300)
def test_shard_dim_like_torch_at_2_ranks() -> None:
    assert run_ranks(body_2, 2, timeout=240) == [["done"]] * 2


@pytest.mark.timeout(300)
def test_shard_dim_like_torch_at_3_ranks() -> None:
    assert run_ranks(body_3, 3, timeout=240) == [["done"]] * 3


@pytest.mark.timeout(300)
def test_shard_dim_post_forward_and_hybrid_at_4_ranks() -> None:
    assert run_ranks(_post_forward_and_hybrid, 4, timeout=240) == [None] * 4
