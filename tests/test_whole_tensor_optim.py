"""Optimizers that look at a whole parameter see DTensors, as under torch's ``fully_shard``.

fullshard steps elementwise optimizers (torch's Adam, SGD, ...) on the plain local shards; any
other optimizer must see the DTensor parameters and gradients, so that a norm is the norm of the
whole tensor and ``full_tensor()`` / ``redistribute`` gather it. Each body trains one seeded
TinyLM sharded by torch's ``fully_shard`` and one sharded by fullshard's, in the same process
group, and compares the parameters after each step (fp32, two ranks: bitwise).
"""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from test_fsdp2_contract import assert_same_params, my_tokens, pair

import fullshard


class TrustRatioSGD(torch.optim.Optimizer):
    """LARS-like: each parameter moves by ``lr * ||p|| / ||g|| * g`` (whole-tensor norms)."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                trust = p.norm() / (p.grad.norm() + 1e-6)
                p.add_(p.grad * trust, alpha=-group["lr"])


class NewtonSchulz(torch.optim.Optimizer):
    """Muon-like: momentum, then 2-D updates orthogonalized by Newton-Schulz iterations on the
    whole matrix. ``gather="full_tensor"`` gathers the momentum with ``full_tensor()``,
    ``"redistribute"`` with ``redistribute(placements=[Replicate()])``; the result goes back to
    the parameter's placement with ``redistribute``. Other parameters take the momentum step."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.9, gather: str = "full_tensor") -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.gather = gather

    @staticmethod
    def orthogonalize(g: torch.Tensor, iters: int = 5) -> torch.Tensor:
        x = g / (g.norm() + 1e-7)
        transposed = x.shape[0] > x.shape[1]
        if transposed:
            x = x.T
        for _ in range(iters):
            a = x @ x.T
            x = 3.4445 * x - 4.7750 * (a @ x) + 2.0315 * (a @ a @ x)
        return x.T if transposed else x

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, Replicate

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                if p.dim() != 2:
                    p.add_(buf, alpha=-group["lr"])
                    continue
                mesh, replicate = p.device_mesh, [Replicate()] * p.device_mesh.ndim
                if self.gather == "full_tensor":
                    full = DTensor.from_local(self.orthogonalize(buf.full_tensor()), mesh, replicate)
                else:
                    full = self.orthogonalize(buf.redistribute(mesh, replicate))
                p.add_(full.redistribute(mesh, p.placements), alpha=-group["lr"])


class ScaledSign(torch.optim.Optimizer):
    """An elementwise custom optimizer (signSGD), declared so with
    ``fullshard.register_elementwise_optimizer``."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class PlainAdam(torch.optim.Adam):
    """A subclass that changes no step math: keeps the local fast path."""


class LambLike(torch.optim.AdamW):
    """A subclass overriding ``step`` to rescale each update to 1% of its parameter's norm (a
    per-tensor trust ratio): must see DTensors."""

    @torch.no_grad()
    def step(self, closure=None):
        before = [p.clone() for g in self.param_groups for p in g["params"]]
        super().step(closure)
        for p, old in zip((p for g in self.param_groups for p in g["params"]), before):
            update = p - old
            p.copy_(old + update * (0.01 * old.norm() / (update.norm() + 1e-6)))


MAKERS = {
    "trust_ratio": lambda ps: TrustRatioSGD(ps),
    "newton_schulz_full_tensor": lambda ps: NewtonSchulz(ps, gather="full_tensor"),
    "newton_schulz_redistribute": lambda ps: NewtonSchulz(ps, gather="redistribute"),
    "lamb_subclass": lambda ps: LambLike(ps, lr=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam_subclass": lambda ps: PlainAdam(ps, lr=1e-2),
    "registered_sign": lambda ps: ScaledSign(ps),
}
WHOLE_TENSOR = ("trust_ratio", "newton_schulz_full_tensor", "newton_schulz_redistribute", "lamb_subclass")


def count_local_steps() -> list[int]:
    """Count, in this process, the parameters fullshard swaps for plain local ones in a step."""
    from fullshard.frontend import optim_local

    calls = [0]
    local_param = optim_local._local_param

    def counting(param, sp):
        calls[0] += 1
        return local_param(param, sp)

    optim_local._local_param = counting
    return calls


def optim_body(rank: int, world: int) -> dict[str, list]:
    fullshard.register_elementwise_optimizer(ScaledSign)
    calls = count_local_steps()
    out = {}
    for name, make in MAKERS.items():
        ref, ours = pair()
        ref_opt, opt = make(ref.parameters()), make(ours.parameters())
        seen = []
        for step in range(3):
            x = my_tokens(step, rank, world)
            for model, o in ((ref, ref_opt), (ours, opt)):
                model(x).logsumexp(-1).mean().backward()
                before = calls[0]
                o.step()
                o.zero_grad()
            seen.append({"Parameter" if calls[0] > before else "DTensor"})
            assert_same_params(ref, ours, f"{name} step {step}")
        # Outside step() the optimizer holds the DTensor parameters and state, either way.
        assert all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"]), name
        out[name] = [sorted(s) for s in seen]
    return out


@pytest.mark.timeout(300)
def test_whole_tensor_optimizers_match_torch() -> None:
    seen = run_ranks(optim_body, 2, timeout=280)[0]
    for name in MAKERS:
        want = ["DTensor"] if name in WHOLE_TENSOR else ["Parameter"]
        assert seen[name] == [want] * 3, (name, seen[name])


def hooks_body(rank: int, world: int) -> dict[str, object]:
    """Code other than the update sees the DTensor parameters, as under torch's ``fully_shard``."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    calls = count_local_steps()
    out: dict[str, object] = {}

    def train(name: str, setup, step) -> list:
        """Train torch's and fullshard's pair 3 steps, bitwise alike; count fullshard's swaps."""
        ref, ours = pair()
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
        extras = [setup(m, o) for m, o in zip((ref, ours), opts)]
        before = calls[0]
        for i in range(3):
            x = my_tokens(i, rank, world)
            for model, o in zip((ref, ours), opts):
                step(model, o, x)
                o.zero_grad()
            assert_same_params(ref, ours, f"{name} step {i}")
        out[name] = calls[0] - before
        return extras

    def loss(model, x):
        return model(x).logsumexp(-1).mean()

    def closure_step(model, o, x):
        def closure():
            o.zero_grad()
            value = loss(model, x)
            value.backward()
            return value

        o.step(closure)

    def plain_step(model, o, x):
        loss(model, x).backward()
        o.step()

    def clip_and_ema(model, o):
        """The optimizer's own hooks: clip by the global norm before, an EMA keyed by id after."""
        ema = {id(p): p.detach().clone() for p in model.parameters()}
        norms: list[float] = []

        def pre(opt, args, kwargs):
            params = [p for g in opt.param_groups for p in g["params"]]
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05).full_tensor()))

        def post(opt, args, kwargs):
            for p in (p for g in opt.param_groups for p in g["params"]):
                ema[id(p)].lerp_(p.detach(), 0.5)

        o.register_step_pre_hook(pre)
        o.register_step_post_hook(post)
        return ema, norms

    train("closure", lambda m, o: None, closure_step)
    (ref_ema, ref_norms), (ema, norms) = train("own_hooks", clip_and_ema, plain_step)
    for e, e0 in zip(ema.values(), ref_ema.values()):
        assert torch.equal(e.full_tensor(), e0.full_tensor())
    assert norms == ref_norms and len(norms) == 3, (norms, ref_norms)
    out["norms"] = norms
    seen: list[str] = []
    handle = register_optimizer_step_pre_hook(
        lambda o, args, kwargs: seen.extend(type(p).__name__ for g in o.param_groups for p in g["params"])
    )
    train("global_hook", lambda m, o: None, plain_step)
    handle.remove()
    train("no_hooks", lambda m, o: None, plain_step)
    out["global_hook_saw"] = sorted(set(seen))
    out["in_backward_calls"] = optimizer_in_backward(rank, world)
    return out


def optimizer_in_backward(rank: int, world: int) -> list[int]:
    """torchtune's optimizer in backward: each parameter steps in its post-accumulate-grad hook,
    which ``fully_shard`` runs once the reduced gradient is on the DTensor; torch's bits."""
    ref, ours = pair()
    calls = []
    for model in (ref, ours):
        opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
        count = [0]

        def hook(p, opts=opts, count=count):
            count[0] += 1
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        calls.append(count)
    for i in range(3):
        x = my_tokens(i, rank, world)
        for model in (ref, ours):
            model(x).logsumexp(-1).mean().backward()
            assert all(p.grad is None for p in model.parameters())
        assert_same_params(ref, ours, f"optimizer in backward, step {i}")
    return [c[0] for c in calls]


@pytest.mark.timeout(300)
def test_closures_and_step_hooks_see_what_torch_shows() -> None:
    """A closure, the optimizer's own step hooks and a global pre-hook registered later each make
    the step run on the DTensors (no local swap), with torch's bits; without them it swaps.
    Post-accumulate-grad hooks run as under torch's ``fully_shard``."""
    got = run_ranks(hooks_body, 2, timeout=280)
    for rank_out in got:
        assert rank_out["closure"] == 0 and rank_out["own_hooks"] == 0 and rank_out["global_hook"] == 0, rank_out
        assert rank_out["no_hooks"] > 0, rank_out
        assert rank_out["global_hook_saw"] == ["DTensor"], rank_out
    assert got[0]["norms"] == got[1]["norms"], got  # the global norm, the same on every rank
    n_params = got[0]["in_backward_calls"][0]
    assert n_params > 0 and all(r["in_backward_calls"] == [n_params, n_params] for r in got), got


def test_elementwise_rule() -> None:
    from fullshard.frontend.optim_local import is_elementwise

    p = [torch.nn.Parameter(torch.zeros(2))]
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.NAdam):
        assert is_elementwise(cls(p)), cls
    assert is_elementwise(PlainAdam(p))
    for opt in (torch.optim.LBFGS(p), torch.optim.Adafactor(p), LambLike(p), TrustRatioSGD(p), ScaledSign(p)):
        assert not is_elementwise(opt), type(opt)
    one = ScaledSign(p)
    fullshard.register_elementwise_optimizer(one)
    assert is_elementwise(one) and not is_elementwise(ScaledSign(p))
    opted_out = torch.optim.Adam(p)
    fullshard.register_elementwise_optimizer(opted_out, elementwise=False)
    assert not is_elementwise(opted_out) and is_elementwise(torch.optim.Adam(p))
    with pytest.raises(TypeError, match="optimizer"):
        fullshard.register_elementwise_optimizer(object())
