"""float16 mixed precision with gradient scaling, against torch's FSDP1 and fully_shard in the
same process group.

The program is torch's with only the import lines changed: FSDP1 with
``MixedPrecision(param_dtype=float16, ...)`` and ``ShardedGradScaler(device="cpu")`` (torch's
from ``torch.distributed.fsdp.sharded_grad_scaler``, fullshard's from
``fullshard.sharded_grad_scaler``), and ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=float16)`` and ``torch.amp.GradScaler("cpu")``. At chosen steps
one rank writes an inf into its own gradient shard after backward (an overflow that only that
rank's shard shows, as one rank's overflowing element does after the reduce-scatter): every rank
must skip the step and back the scale off together, as under torch.

Compared every step: the loss, the scale, the clip norm and the full parameters; bitwise at 1 and
2 ranks, except where fullshard's clip sums the norm in float64 (last bits of the norm, and of the
parameters with a float32 reduction). At 3 ranks a float16 sum of three gradients depends on the
order of addition (gloo's reduce-scatter under torch, fullshard's all-to-all and local sum), so
the parameters agree to float16 rounding while the scales and skipped steps stay identical.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from dist import run_ranks
from models import Block, batch, local, make_stack

F16 = torch.float16
INF_STEPS = (1, 3)  # steps at which the last rank writes an inf into its own gradient shard


# ---------------------------------------------------------------------------- building
def _fsdp1(kind: str, opts: dict[str, Any]) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if kind == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from fullshard import FullyShardedDataParallel as FSDP
    mp = MixedPrecision(
        param_dtype=F16,
        reduce_dtype=opts.get("reduce"),
        buffer_dtype=F16,
        keep_low_precision_grads=opts.get("keep_low", False),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP(
            make_stack(0, (1,)),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
            mixed_precision=mp,
            sharding_strategy=ShardingStrategy[opts.get("strategy", "FULL_SHARD")],
        )


def _fsdp2(kind: str, opts: dict[str, Any]) -> torch.nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard
    model = make_stack(0, (1,))
    kw: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=F16, reduce_dtype=opts.get("reduce")),
        "reshard_after_forward": opts.get("reshard", True),
    }
    if opts.get("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _scaler(kind: str, front_end: int, opts: dict[str, Any]) -> Any:
    kw = {"init_scale": 2.0**8, "growth_interval": 2}
    if front_end == 2 and not opts.get("sharded_scaler"):
        return torch.amp.GradScaler("cpu", **kw)
    if kind == "torch" or opts.get("torch_scaler"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    else:
        from fullshard.sharded_grad_scaler import ShardedGradScaler
    return ShardedGradScaler(device="cpu", **kw)


def _optimizer(front_end: int, model: torch.nn.Module, opts: dict[str, Any]) -> torch.optim.Optimizer:
    if front_end == 1 and "fused" not in opts:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=opts.get("fused"))


def _full(kind: str, front_end: int, model: torch.nn.Module) -> list[torch.Tensor]:
    if front_end == 2:
        return [p.full_tensor().detach().clone() for p in model.parameters()]
    if kind == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from fullshard import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model, writeback=False):
        return [p.detach().float().clone() for p in model.parameters()]


def _inject_inf(model: torch.nn.Module, front_end: int) -> None:
    """Write an inf into the first non-empty local gradient shard of this rank."""
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if front_end == 2 else p.grad
        if g.numel():
            g.view(-1)[0] = float("inf")
            return
    raise AssertionError("no gradient shard on this rank to write an inf into")


# ---------------------------------------------------------------------------- training
def _train(rank: int, world: int, kind: str, front_end: int, opts: dict[str, Any]) -> list[tuple]:
    """Five fp16 steps; per step (loss, scale, (clip norm, its dtype) or None, gradient dtypes,
    full parameters)."""
    model = (_fsdp1 if front_end == 1 else _fsdp2)(kind, opts)
    opt = _optimizer(front_end, model, opts)
    scaler = _scaler(kind, front_end, opts)
    accum = opts.get("accum", 1)
    out = []
    for step in range(5):
        opt.zero_grad()
        for micro in range(accum):
            x, y = batch(step * 10 + micro, 12)
            last = micro == accum - 1
            ctx: Any = contextlib.nullcontext()
            if front_end == 2:
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
            elif not last:
                ctx = model.no_sync()  # type: ignore[operator]
            with ctx:
                loss = torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world))
                scaler.scale(loss).backward()
        if step in INF_STEPS and rank == world - 1:
            _inject_inf(model, front_end)
        grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        norm = None
        if opts.get("clip"):
            scaler.unscale_(opt)
            if front_end == 1:
                n = model.clip_grad_norm_(1.0)  # type: ignore[operator]
            else:
                n = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                n = n.full_tensor() if hasattr(n, "full_tensor") else n
            norm = (float(n), str(n.dtype))
        scaler.step(opt)
        scaler.update()
        out.append((loss.item(), scaler.get_scale(), norm, grad_dtypes, _full(kind, front_end, model)))
    return out


def _both(rank: int, world: int, cases: list[tuple[int, dict[str, Any]]]) -> list[tuple[list, list]]:
    return [(_train(rank, world, "torch", fe, opts), _train(rank, world, "fullshard", fe, opts)) for fe, opts in cases]


def _check(results: list[list[tuple[list, list]]], cases: list[tuple[int, dict[str, Any]]], exact: bool) -> None:
    """torch's run (first) against fullshard's (second), per rank, case and step; and every
    rank's scales the same; and the inf steps skipped (parameters unchanged)."""
    for c, (fe, opts) in enumerate(cases):
        what = f"fully_shard {opts}" if fe == 2 else f"FSDP1 {opts}"
        scales = {tuple(s[1] for s in per_rank[c][1]) for per_rank in results}
        assert len(scales) == 1, f"{what}: ranks' scales differ: {scales}"
        for rank, per_rank in enumerate(results):
            ref, got = per_rank[c]
            for step, (a, b) in enumerate(zip(ref, got)):
                at = f"{what} rank {rank} step {step}"
                assert a[1] == b[1], f"{at}: scale {a[1]} != {b[1]}"
                assert a[3] == b[3], f"{at}: gradient dtypes {a[3]} != {b[3]}"
                if a[2] is not None:  # the norm's value and dtype (FSDP1: the gradients')
                    rel = 1e-6 if exact else 1e-4  # 3 ranks: gradients apart by float16 rounding
                    assert a[2][1] == b[2][1], f"{at}: norm dtype {a[2][1]} != {b[2][1]}"
                    assert a[2][0] == pytest.approx(b[2][0], rel=rel, nan_ok=True), f"{at}: norm {a[2]} != {b[2]}"
                if step in INF_STEPS:  # skipped on every rank: nothing moved
                    assert b[1] == got[step - 1][1] / 2, f"{at}: the scale did not back off"
                    for p, q in zip(got[step - 1][4], b[4]):
                        assert torch.equal(p, q), f"{at}: a parameter changed in a skipped step"
                bitwise = exact and not (opts.get("clip") and opts.get("reduce") == torch.float32)
                for i, (p, q) in enumerate(zip(a[4], b[4])):
                    if bitwise:
                        assert a[0] == b[0], f"{at}: loss {a[0]} != {b[0]}"
                        assert torch.equal(p, q), f"{at}: parameter {i}: max |diff| {(p - q).abs().max().item()}"
                    else:  # float64 norm sum (2 ranks), float16 order of addition (3 ranks)
                        torch.testing.assert_close(q, p, rtol=0, atol=5e-4, msg=lambda m: f"{at}: parameter {i}: {m}")


TWO_RANK_CASES: list[tuple[int, dict[str, Any]]] = [
    (1, {}),
    (1, {"clip": True}),
    (1, {"reduce": torch.float32, "clip": True}),
    (1, {"accum": 2}),
    (1, {"strategy": "NO_SHARD"}),
    (1, {"strategy": "SHARD_GRAD_OP", "clip": True}),
    (2, {}),
    (2, {"clip": True}),
    (2, {"accum": 2, "clip": True}),
    (2, {"reshard": False}),
    (2, {"offload": True, "clip": True}),
    (2, {"sharded_scaler": True, "clip": True}),
]


@pytest.mark.timeout(300)
def test_one_rank_overflow_skips_everywhere_like_torch_two_ranks() -> None:
    """An inf in one rank's shard: every rank skips and backs off as under torch, bitwise."""
    _check(run_ranks(_both, 2, TWO_RANK_CASES, timeout=280), TWO_RANK_CASES, exact=True)


# torch's own scaler on fullshard's model works as well (a program need not change that import).
KEEP_LOW_CASES: list[tuple[int, dict[str, Any]]] = [
    (1, {"keep_low": True, "torch_scaler": True}),
    (1, {"keep_low": True, "reduce": F16, "torch_scaler": True, "clip": True}),
]


@pytest.mark.timeout(200)
def test_keep_low_precision_grads_like_torch() -> None:
    """``MixedPrecision(keep_low_precision_grads=True)``: float16 gradients on float32 shards,
    unscaled by the scaler in float16, as torch's. ``summon_full_params`` used to fail on exit
    putting such a gradient back ("attempting to assign a gradient with dtype 'c10::Half' to a
    tensor with grad_dtype 'Float'")."""
    _check(run_ranks(_both, 2, KEEP_LOW_CASES, timeout=180), KEEP_LOW_CASES, exact=True)


ODD_CASES: list[tuple[int, dict[str, Any]]] = [(1, {"clip": True}), (2, {"clip": True}), (2, {"accum": 2})]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 3])
def test_one_rank_overflow_like_torch_one_and_three_ranks(world: int) -> None:
    _check(run_ranks(_both, world, ODD_CASES, timeout=280), ODD_CASES, exact=world == 1)


def test_sharded_grad_scaler_at_torchs_module_path() -> None:
    """``torch.distributed.fsdp.sharded_grad_scaler`` with the module name changed."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

    from fullshard.sharded_grad_scaler import ShardedGradScaler

    assert issubclass(ShardedGradScaler, TorchScaler)
    scaler = ShardedGradScaler(device="cpu", init_scale=4.0)
    assert scaler.is_enabled() and scaler.get_scale() == 4.0


# ---------------------------------------------------------------------------- fused optimizers
def _fused_body(rank: int, world: int) -> list[tuple[str, list]]:
    """Fused AdamW (steps and skips by itself: ``_step_supports_amp_scaling``) with fullshard's
    scaler, with and without ``unscale_``, against the same run with the ordinary AdamW."""
    out = []
    for clip in (False, True):
        for fused in (False, True):
            opts = {"fused": fused, "clip": clip}
            out.append((f"clip={clip} fused={fused}", _train(rank, world, "fullshard", 1, opts)))
    return out


@pytest.mark.timeout(200)
def test_fused_optimizer_skips_on_every_rank() -> None:
    """torch's ShardedGradScaler does not share the found-inf flag when a fused optimizer's step
    checks the gradients itself (the ranks without the inf stepped, the scales split), and after
    ``unscale_`` hands it a (1,) flag the fused step refuses; fullshard's shares and reshapes it."""
    results = run_ranks(_fused_body, 2, timeout=180)
    for c in range(len(results[0])):
        name = results[0][c][0]
        scales = {tuple(s[1] for s in per_rank[c][1]) for per_rank in results}
        assert len(scales) == 1, f"{name}: ranks' scales differ: {scales}"
    for per_rank in results:
        runs = dict(per_rank)
        for clip in (False, True):
            plain, fused = runs[f"clip={clip} fused=False"], runs[f"clip={clip} fused=True"]
            for step, (a, b) in enumerate(zip(plain, fused)):
                assert a[1] == b[1], f"clip={clip} step {step}: scale {a[1]} != {b[1]}"
                for p, q in zip(a[4], b[4]):  # the fused kernel rounds differently in the last bits
                    torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- resume
def _resume_body(rank: int, world: int) -> list[bool]:
    """Six steps straight against three, a checkpoint (full model and optimizer state, the scaler's
    ``state_dict()``), fresh objects that load it, and three more."""
    from fullshard import FullyShardedDataParallel as FSDP
    from fullshard.sharded_grad_scaler import ShardedGradScaler

    def build() -> tuple[Any, Any, Any]:
        model = _fsdp1("fullshard", {})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, ShardedGradScaler(device="cpu", init_scale=2.0**8, growth_interval=2)

    def steps(model: Any, opt: Any, scaler: Any, first: int, last: int) -> None:
        for step in range(first, last):
            x, y = batch(step, 12)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world))
            scaler.scale(loss).backward()
            if step == 2 and rank == world - 1:
                _inject_inf(model, 1)
            scaler.step(opt)
            scaler.update()

    straight = build()
    steps(*straight, 0, 6)
    first = build()
    steps(*first, 0, 3)
    saved = (first[0].state_dict(), FSDP.optim_state_dict(first[0], first[1]), first[2].state_dict())
    assert saved[2]["scale"] == 2.0**8  # grown after steps 0-1, backed off at step 2
    resumed = build()
    resumed[0].load_state_dict(saved[0])
    resumed[1].load_state_dict(FSDP.optim_state_dict_to_load(resumed[0], resumed[1], saved[1]))
    resumed[2].load_state_dict(saved[2])
    steps(*resumed, 3, 6)
    same = [straight[2].get_scale() == resumed[2].get_scale()]
    same += [torch.equal(a, b) for a, b in zip(_full("fullshard", 1, straight[0]), _full("fullshard", 1, resumed[0]))]
    return same


@pytest.mark.timeout(200)
def test_scaler_state_dict_resume_bitwise() -> None:
    for same in run_ranks(_resume_body, 2, timeout=180):
        assert all(same), same
