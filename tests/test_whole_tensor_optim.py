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


def seen_types(opt: torch.optim.Optimizer) -> list[set[str]]:
    """Record, per step, the parameter types the optimizer's step body sees (a per-instance pre
    hook runs after fullshard's global one, just before the step itself)."""
    seen: list[set[str]] = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.append({type(p).__name__ for g in o.param_groups for p in g["params"]})
    )
    return seen


def optim_body(rank: int, world: int) -> dict[str, list]:
    fullshard.register_elementwise_optimizer(ScaledSign)
    out = {}
    for name, make in MAKERS.items():
        ref, ours = pair()
        ref_opt, opt = make(ref.parameters()), make(ours.parameters())
        seen = seen_types(opt)
        for step in range(3):
            x = my_tokens(step, rank, world)
            for model, o in ((ref, ref_opt), (ours, opt)):
                model(x).logsumexp(-1).mean().backward()
                o.step()
                o.zero_grad()
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
        # One entry per hooked step() call: 3 steps, or 6 for LambLike once the process has made a
        # plain AdamW (torch then hooks AdamW.step too, which LambLike.step calls through super()).
        assert len(seen[name]) in (3, 6) and all(s == want for s in seen[name]), (name, seen[name])


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
