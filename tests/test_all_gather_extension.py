"""FSDP2's all-gather extension on fullshard's ``fully_shard``, against torch's in the same group.

The weights of a small MLP are :class:`agext_tensors.Bf16CommWeight` (fp32 values that
all-gather in bfloat16). Units: the first Linear (extension weight + plain bias), the second
(extension weight only, 5 rows: uneven at 2 ranks, so the pre hook pads), and the root (the
last Linear: extension weight + plain bias). Two modes: no mixed precision (the post hook
returns a :class:`agext_tensors.Bf16Stored`, fp32 outside, the gathered bfloat16 inside) and
``param_dtype=bfloat16, reduce_dtype=float32`` (the post hook returns the gathered tensor).
Each step compares the hook calls (count and the kinds of every argument), what the forward
sees, the losses, the shards' gradients and, after SGD (momentum) and AdamW steps, the shards.
"""

from __future__ import annotations

import pytest
import torch
from agext_tensors import (
    CALLS,
    Bf16CommWeight,
    Bf16Stored,
    MeshOnlyWeight,
    PlainWrapper,
    RowInt8Weight,
    ThreeArgWeight,
    wrap_weights,
)
from dist import run_ranks
from torch import nn

from fullshard.engine.hooks import fsdp_state
from fullshard.engine.unit import TrainingState, Unit


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5, bias=False), nn.ReLU(), nn.Linear(5, 4))
    return wrap_weights(m)


def _shard(m: nn.Sequential, impl: str, mp: bool) -> nn.Sequential:
    import torch.distributed.fsdp as tf

    import fullshard as fs

    mod = tf if impl == "torch" else fs
    kw = {"mp_policy": mod.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    for i in (0, 2):
        mod.fully_shard(m[i], **kw)
    mod.fully_shard(m, **kw)
    return m


def _inner(t: torch.Tensor) -> torch.Tensor:
    return t._t if isinstance(t, (Bf16CommWeight, Bf16Stored)) else t


def _locals(m: nn.Module, grads: bool = False) -> list[tuple[str, type, torch.Tensor]]:
    out = []
    for name, p in m.named_parameters():
        t = p.grad if grads else p
        local = t._local_tensor
        out.append((name, type(local), _inner(local)))
    return out


def _seen(m: nn.Sequential) -> list:
    """What each Linear's forward sees as its weight: (class, dtype, shape), recorded per call.

    torch's forward sees an ``nn.Parameter`` (an autograd leaf) where the post hook returned a
    plain tensor; fullshard's sees a plain tensor (the output of the unit's autograd node), as it
    does for every parameter: recorded as the same class.
    """
    seen: list = []

    def record(mod: nn.Module, args: tuple) -> None:
        w = mod.weight
        seen.append(("Tensor" if type(w) is nn.Parameter else type(w).__name__, w.dtype, tuple(w.shape)))

    for lin in (m[0], m[2], m[4]):
        lin.register_forward_pre_hook(record)
    return seen


def _step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[torch.Tensor, list, list]:
    CALLS.clear()
    loss = m(x).float().square().mean()
    loss.backward()
    grads = _locals(m, grads=True)
    opt.step()
    opt.zero_grad()
    return loss.detach(), grads, list(CALLS)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def parity_body(rank: int, world: int, mp: bool) -> dict:
    counts = {}
    for opt_name, make_opt in OPTIMIZERS.items():
        ref, ours = _shard(_model(), "torch", mp), _shard(_model(), "fullshard", mp)
        assert all(type(a[2]) is type(b[2]) and _equal(a[2], b[2]) for a, b in zip(_locals(ref), _locals(ours)))
        kinds = [Bf16CommWeight, torch.Tensor, Bf16CommWeight, Bf16CommWeight, torch.Tensor]
        assert [t for _, t, _ in _locals(ours)] == kinds  # the shards keep their class
        ref_opt, opt = make_opt(ref.parameters()), make_opt(ours.parameters())
        seen_ref, seen = _seen(ref), _seen(ours)
        total = 0
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            loss_ref, grads_ref, calls_ref = _step(ref, ref_opt, x)
            loss, grads, calls = _step(ours, opt, x)
            what = f"{opt_name} mp={mp} step {step}"
            assert sorted(calls, key=repr) == sorted(calls_ref, key=repr), f"{what}: hook calls {calls} vs {calls_ref}"
            assert _equal(loss, loss_ref), f"{what}: loss {loss.item()} vs {loss_ref.item()}"
            for (name, t_ref, g_ref), (_, t, g) in zip(grads_ref, grads):
                assert t is t_ref and _equal(g, g_ref), f"{what}: grad of {name}"
            for (name, t_ref, v_ref), (_, t, v) in zip(_locals(ref), _locals(ours)):
                assert t is t_ref and _equal(v, v_ref), f"{what}: {name} differs by {(v - v_ref).abs().max()}"
            for u in {id(s.unit): s.unit for s in map(fsdp_state, ours.modules()) if s is not None}.values():
                assert u.training_state is TrainingState.IDLE and not u.has_pending_reduce, (what, u.name)
            total += len(calls)
        assert seen == seen_ref, f"{opt_name}: forward saw {seen} vs {seen_ref}"
        counts[opt_name] = total
    return counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16-mp"])
def test_matches_torch_fully_shard(world: int, mp: bool) -> None:
    counts = run_ranks(parity_body, world, mp)[0]
    # per step: forward gathers 3 units, backward regathers the 2 non-root ones; a pre and a post call each
    assert counts == {"sgd": 3 * 5 * 2, "adamw": 3 * 5 * 2}, counts


def plain_units_body(rank: int, world: int) -> list[str]:
    import fullshard as fs

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    wrap_weights(m[1:])
    fs.fully_shard(m[0])
    fs.fully_shard(m)
    kinds = [type(fsdp_state(m[0]).unit).__name__, type(fsdp_state(m).unit).__name__]
    assert type(fsdp_state(m[0]).unit) is Unit  # no extension parameter: the plain unit, unchanged
    m(torch.randn(2, 8)).sum().backward()
    return kinds


@pytest.mark.timeout(120)
def test_only_units_with_extension_parameters_change() -> None:
    assert run_ranks(plain_units_body, 1)[0] == ["Unit", "ExtensionUnit"]


class _PreOnly(PlainWrapper):
    def fsdp_pre_all_gather(self, mesh):  # type: ignore[no-untyped-def]
        return (self._t,), None


def refusals_body(rank: int, world: int) -> list[str]:
    import fullshard as fs

    messages = []
    for cls, error in ((PlainWrapper, NotImplementedError), (_PreOnly, ValueError)):
        m = wrap_weights(nn.Sequential(nn.Linear(4, 4)), cls)
        with pytest.raises(error) as info:
            fs.fully_shard(m)
        messages.append(str(info.value))
    m = wrap_weights(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(NotImplementedError) as info:
        fs.FullyShardedDataParallel(m)
    messages.append(str(info.value))
    return messages


@pytest.mark.timeout(120)
def test_refusals_name_the_parameter_and_the_fix() -> None:
    """A tensor-subclass parameter without the hooks is refused (fullshard would drop the
    subclass); so are a lone hook and the FSDP1 wrapper, which does not run extensions."""
    no_hooks, pre_only, wrapper = run_ranks(refusals_body, 1)[0]
    assert "0.weight is a PlainWrapper" in no_hooks and "Define both hooks" in no_hooks
    assert "defines fsdp_pre_all_gather but not fsdp_post_all_gather" in pre_only
    assert "0.weight" in wrapper and "fully_shard" in wrapper


class _BiasOnly(nn.Module):
    """A unit whose extension weight its forward never reads (only its plain bias)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n))
        self.bias = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


def accumulate_body(rank: int, world: int) -> int:
    """Gradient accumulation (sync off for the first of two micro-batches) and a unit whose
    extension weight gets no gradient, so its extension part never reports in backward."""
    import torch.distributed.fsdp as tf

    import fullshard as fs

    models = []
    for mod in (tf, fs):
        torch.manual_seed(0)
        m = wrap_weights(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), _BiasOnly(6), nn.Linear(6, 3)))
        for i in (0, 2):
            mod.fully_shard(m[i])
        models.append(mod.fully_shard(m))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    calls = []
    for step in range(2):
        for micro in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro + 100 * rank))
            losses = []
            for m in models:
                CALLS.clear()
                m.set_requires_gradient_sync(micro == 1)
                loss = m(x).square().mean()
                loss.backward()
                losses.append(loss.detach())
                calls.append(sorted(CALLS, key=repr))
            assert _equal(losses[1], losses[0]), (step, micro)
            assert calls[-1] == calls[-2], (step, micro, calls[-1], calls[-2])
        (ref, g_ref), (ours, g) = [(m, _locals(m, grads=False)) for m in models]
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            if p.grad is None:
                assert q.grad is None, name
            else:
                assert _equal(_inner(q.grad._local_tensor), _inner(p.grad._local_tensor)), (step, name)
        assert ref[2].weight.grad is None and ours[2].weight.grad is None  # never used
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, _, v_ref), (_, _, v) in zip(_locals(ref), _locals(ours)):
            assert _equal(v, v_ref), (step, name)
    return sum(len(c) for c in calls[1::2])


@pytest.mark.timeout(200)
def test_gradient_accumulation_and_an_unused_extension_weight() -> None:
    assert run_ranks(accumulate_body, 2)[0] > 0


def _load_assign(m: nn.Module, full: dict[str, torch.Tensor], rank: int, world: int) -> None:
    """Load ``full`` into ``m`` (sharded on the meta device) as torchtune loads QLoRA's NF4
    weights: each extension parameter a DTensor over a subclass of this rank's rows, the
    others ``distribute_tensor``; ``load_state_dict(assign=True)`` puts them in place."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {}
    for name, meta in m.state_dict().items():
        if isinstance(meta._local_tensor, Bf16CommWeight):
            rows = torch.chunk(_inner(full[name]), world)[rank].clone()
            value = DTensor.from_local(
                Bf16CommWeight(rows),
                meta.device_mesh,
                meta.placements,
                run_check=False,
                shape=meta.shape,
                stride=meta.stride(),
            )
        else:
            value = distribute_tensor(full[name], meta.device_mesh, meta.placements)
        sharded[name] = nn.Parameter(value)
    m.load_state_dict(sharded, assign=True)


def meta_assign_body(rank: int, world: int) -> list[float]:
    """Extension parameters sharded on the meta device, then assigned (load_state_dict(assign=True)
    of DTensors over the subclass): fullshard takes them at the first unshard, as torch does at
    its lazy init. The uneven layer (5 rows) gets rows 3 and 2 at 2 ranks."""
    full = _model().state_dict()
    models = []
    for impl in ("torch", "fullshard"):
        with torch.device("meta"):
            m = _shard(_model(), impl, mp=False)
        _load_assign(m, full, rank, world)
        models.append(m)
    assert [t for _, t, _ in _locals(models[1])] == [t for _, t, _ in _locals(models[0])]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    losses = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * rank))
        (loss_ref, grads_ref, calls_ref), (loss, grads, calls) = [_step(m, o, x) for m, o in zip(models, opts)]
        assert _equal(loss, loss_ref) and sorted(calls, key=repr) == sorted(calls_ref, key=repr), step
        for (name, _, g_ref), (_, _, g) in zip(grads_ref, grads):
            assert _equal(g, g_ref), (step, name)
        for u in {id(s.unit): s.unit for s in map(fsdp_state, models[1].modules()) if s is not None}.values():
            assert u.training_state is TrainingState.IDLE and not u.has_pending_reduce, (step, u.name)
        losses.append(loss.item())
    for (name, t_ref, v_ref), (_, t, v) in zip(_locals(models[0]), _locals(models[1])):
        assert t is t_ref is Bf16CommWeight or name.endswith("bias"), name  # the shards keep their class
        assert _equal(v, v_ref), name
    with torch.device("meta"):
        never_loaded = _shard(_model(), "fullshard", mp=False)
    with pytest.raises(RuntimeError, match=r"\['4.weight'\] are still on the meta device; load a state dict"):
        never_loaded(torch.randn(4, 8))
    return losses


@pytest.mark.timeout(200)
def test_meta_device_then_load_state_dict_assign() -> None:
    """torchtune's QLoRA loading (sharded on meta, NF4 shards assigned): as torch's fully_shard."""
    losses = run_ranks(meta_assign_body, 2)[0]
    assert len(losses) == 2 and losses[0] != losses[1]


def signatures_body(rank: int, world: int) -> str:
    """The older one-argument pre hook runs as torch runs it; another arity is refused."""
    import torch.distributed.fsdp as tf

    import fullshard as fs

    models = []
    for mod in (tf, fs):
        torch.manual_seed(0)
        m = wrap_weights(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)), MeshOnlyWeight)
        mod.fully_shard(m[0])
        models.append(mod.fully_shard(m))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * rank))
        (loss_ref, _, calls_ref), (loss, _, calls) = [_step(m, o, x) for m, o in zip(models, opts)]
        assert _equal(loss, loss_ref) and sorted(calls, key=repr) == sorted(calls_ref, key=repr), (step, calls)
        assert any(c[0] == "pre-mesh-only" for c in calls)
    for (name, _, v_ref), (_, _, v) in zip(_locals(models[0]), _locals(models[1])):
        assert _equal(v, v_ref), name
    m = fs.fully_shard(wrap_weights(nn.Sequential(nn.Linear(4, 4)), ThreeArgWeight))
    with pytest.raises(TypeError) as info:
        m(torch.randn(2, 4))
    return str(info.value)


@pytest.mark.timeout(200)
def test_pre_hook_signatures() -> None:
    message = run_ranks(signatures_body, 2)[0]
    assert "ThreeArgWeight.fsdp_pre_all_gather takes 2 arguments" in message


def _int8_models(impls: tuple) -> list[nn.Module]:
    models = []
    for mod in impls:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
        if mod is not None:
            wrap_weights(m, RowInt8Weight)
            for i in (0, 2):
                mod.fully_shard(m[i])
            mod.fully_shard(m)
        models.append(m)
    return models


def _dequantized_step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple:
    """One step of an unsharded model whose forward sees each weight quantized to int8 rows and
    back, its gradient going straight to the weight: what the extension computes at one rank."""

    def seen(w: torch.Tensor) -> torch.Tensor:
        scale = w.detach().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        value = (w.detach() / scale).round().to(torch.int8).to(torch.float32) * scale
        return value + (w - w.detach())  # the value exactly, the gradient to w

    weights = {n: seen(p) for n, p in m.named_parameters() if p.dim() == 2}
    loss = torch.func.functional_call(m, weights, (x,)).float().square().mean()
    loss.backward()
    grads = [(n, torch.Tensor, p.grad.clone()) for n, p in m.named_parameters()]
    opt.step()
    opt.zero_grad()
    return loss.detach(), grads, None


def int8_body(rank: int, world: int) -> int:
    """Two all-gather inputs of two dtypes per parameter (int8 rows and fp32 scales), gathered
    together, and a post hook that writes its ``out=`` in place. At 2 ranks against torch's
    ``fully_shard``; at 1 rank against an unsharded model that quantizes in its forward, since
    torch's ``fully_shard`` at one rank hands the post hook only the first all-gather input."""
    import torch.distributed.fsdp as tf

    import fullshard as fs

    models = _int8_models((tf if world > 1 else None, fs))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    count = 0
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * rank))
        loss_ref, grads_ref, calls_ref = (_step if world > 1 else _dequantized_step)(models[0], opts[0], x)
        loss, grads, calls = _step(models[1], opts[1], x)
        assert _equal(loss, loss_ref), (step, loss, loss_ref)
        assert calls_ref is None or sorted(calls, key=repr) == sorted(calls_ref, key=repr), (step, calls, calls_ref)
        for (name, _, g_ref), (_, _, g) in zip(grads_ref, grads):
            assert _equal(g, g_ref), (step, name)
        count += len(calls)
    ref_values = _locals(models[0]) if world > 1 else [(n, None, p.detach()) for n, p in models[0].named_parameters()]
    for (name, _, v_ref), (_, _, v) in zip(ref_values, _locals(models[1])):
        assert _equal(v, v_ref), name
    return count


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_inputs_of_several_dtypes(world: int) -> None:
    assert run_ranks(int8_body, world)[0] == 3 * 5 * 2


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Boom.apply(x) if self.armed else x


def failed_backward_body(rank: int, world: int) -> str:
    """A micro-batch with sync off, then one (sync still off) whose backward raises between
    units: what the first accumulated is dropped from the extension weights as from the plain parameters, so
    after ``zero_grad`` the next step's gradients are those of a model that never saw either."""
    import fullshard as fs

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = wrap_weights(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6), _Raises(), nn.Linear(6, 3)))
        for i in (0, 2):
            fs.fully_shard(m[i])
        models.append(fs.fully_shard(m))
    failing, fresh = models
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    failing.set_requires_gradient_sync(False)
    failing(x).square().mean().backward()
    failing[3].armed = True
    try:
        failing(x).square().mean().backward()
    except RuntimeError as e:
        assert "boom" in str(e), e
    failing[3].armed = False
    failing.set_requires_gradient_sync(True)
    failing.zero_grad()
    for m in models:
        m(2 * x).square().mean().backward()
    for (name, p), q in zip(failing.named_parameters(), fresh.parameters()):
        assert _equal(_inner(p.grad._local_tensor), _inner(q.grad._local_tensor)), name
    return "same"


@pytest.mark.timeout(120)
def test_a_failed_backward_drops_the_extension_gradients_held_too() -> None:
    assert run_ranks(failed_backward_body, 2, timeout=100) == ["same", "same"]
