"""Mixed precision: what crosses the wire, in which dtype, and how close training stays."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from models import Block, ConvBlock, batch, images, make_cnn, make_stack
from torch import nn

from fullshard import probes


def _mp_model(mp, strategy="FULL_SHARD"):
    from fullshard import FSDP, ShardingStrategy
    from fullshard.frontend.wrap import ModuleWrapPolicy

    ref = make_stack()
    return ref, FSDP(
        copy.deepcopy(ref),
        sharding_strategy=ShardingStrategy[strategy],
        mixed_precision=mp,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )


def wire_body(rank: int, world: int) -> list[str]:
    from fullshard import MixedPrecision

    checked = []
    for mp, gather_dtype, reduce_dtype in [
        (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), torch.bfloat16, torch.float32),
        (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16, torch.float16),
        (None, torch.float32, torch.float32),
    ]:
        _, model = _mp_model(mp)
        units = {m.unit.shard_numel for m in model.fsdp_modules(model)}
        x, y = batch(0, 4 * world)
        with probes.enabled(collective_log=True) as p:
            out = model(x[4 * rank : 4 * rank + 4])
            assert out.dtype == gather_dtype
            torch.nn.functional.mse_loss(out.float(), y[4 * rank : 4 * rank + 4]).backward()
        log = p.collectives.log or []
        gathers = [e for e in log if e[0] == "all_gather"]
        reduces = [e for e in log if e[0] == "reduce_scatter"]
        assert gathers and reduces
        assert all(dt == gather_dtype for _, dt, _ in gathers), gathers
        assert all(n in units for _, _, n in gathers), (gathers, units)  # one shard's elements
        assert all(dt == reduce_dtype for _, dt, _ in reduces), reduces
        expected_bytes = sum(n * torch.finfo(gather_dtype).bits // 8 * (world - 1) for _, _, n in gathers)
        assert p.collectives.bytes_sent["all_gather"] == expected_bytes
        for p in model.parameters():  # shards and their gradients stay float32
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        checked.append(str(gather_dtype))
    return checked


@pytest.mark.timeout(200)
def test_collective_dtypes_and_bytes() -> None:
    assert len(run_ranks(wire_body, 2, timeout=180)[0]) == 4


def accuracy_body(rank: int, world: int) -> float:
    from fullshard import MixedPrecision

    ref, model = _mp_model(
        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    n = 12 // world
    for step in range(10):
        x, y = batch(step, 12)
        opt.zero_grad()
        torch.nn.functional.mse_loss(
            model(x[rank * n : (rank + 1) * n]).float(), y[rank * n : (rank + 1) * n]
        ).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    full, want = model.state_dict(), ref.state_dict()
    for k, v in want.items():
        assert full[k].dtype == v.dtype  # the state dict holds the original (fp32) values
        # Per tensor, zero-initialized LayerNorm biases have tiny norms, so bf16 compute noise
        # alone (identical with an fp32 reduction) reaches ~2.5% of them at 3 ranks.
        assert ((full[k] - v).norm() / v.norm()).item() <= 5e-2, k
    a = torch.cat([full[k].flatten() for k in want])
    b = torch.cat([v.flatten() for v in want.values()])
    whole = ((a - b).norm() / b.norm()).item()
    assert whole <= 2e-2, whole
    return whole


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_bf16_training_stays_close_to_fp32(world: int) -> None:
    assert run_ranks(accuracy_body, world, timeout=180)[0] <= 2e-2


def overflow_body(rank: int, world: int) -> list[float]:
    from fullshard import FSDP, MixedPrecision

    # Each rank's gradient: their sum overflows float16's 65504, the sum of the predivided ones
    # (by 2 at 2-4 ranks, torch's factor) does not.
    big = BIG_GRAD[world]
    out = []
    for keep_low in (False, True):
        model = FSDP(
            nn.Linear(1, 4, bias=False),
            mixed_precision=MixedPrecision(torch.float16, torch.float16, keep_low_precision_grads=keep_low),
        )
        (model(torch.full((1, 1), big)).sum()).backward()
        g = next(model.parameters()).grad
        assert g is not None
        assert g.dtype == (torch.float16 if keep_low else torch.float32)
        assert torch.isfinite(g.float()).all(), g
        out.append(g.float().sum().item())
    return out


BIG_GRAD = {2: 4.0e4, 3: 3.0e4, 4: 3.0e4}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_float16_reduction_does_not_overflow(world: int) -> None:
    results = run_ranks(overflow_body, world, timeout=180)
    total = sum(sum(r) for r in results) / 2  # both variants over all shards
    assert abs(total - 4 * BIG_GRAD[world]) < 1e2, results


def test_predivide_factor_is_torchs() -> None:
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    from fullshard.comm.collectives import predivide_factor

    for ranks in range(1, 130):
        assert predivide_factor(ranks) == DefaultState._get_gradient_predivide_factor(ranks), ranks


def buffers_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP, MixedPrecision, StateDictType

    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model = FSDP(net, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16))
    assert net[1].running_mean.dtype == torch.bfloat16
    seen = []
    net[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    model(torch.randn(8, 4)).sum().backward()
    sd = model.state_dict()
    assert sd["1.running_mean"].dtype == torch.float32 and sd["1.num_batches_tracked"].dtype == torch.int64
    assert sd["0.weight"].dtype == torch.float32
    # As torch FSDP1: the sharded state dict (and so a checkpoint) holds buffers in their original
    # dtype too; the local one holds them as the module does.
    kinds = ((StateDictType.SHARDED_STATE_DICT, torch.float32), (StateDictType.LOCAL_STATE_DICT, torch.bfloat16))
    for kind, dtype in kinds:
        with FSDP.state_dict_type(model, kind):
            sd = model.state_dict()
        assert sd["1.running_mean"].dtype == dtype and sd["1.num_batches_tracked"].dtype == torch.int64, kind
        torch.testing.assert_close(sd["1.running_mean"].float(), net[1].running_mean.float())
    return [str(d) for d in seen]


@pytest.mark.timeout(120)
def test_buffers_and_root_inputs_are_cast() -> None:
    assert run_ranks(buffers_body, 2, timeout=100)[0] == ["torch.bfloat16"]


# ---------------------------------------------------------------------- modules kept in full precision
def test_module_classes_to_ignore_is_checked() -> None:
    from fullshard import MixedPrecision

    default = MixedPrecision(torch.bfloat16)._module_classes_to_ignore
    assert default == (nn.modules.batchnorm._BatchNorm,)  # torch's default
    assert MixedPrecision(_module_classes_to_ignore=[nn.LayerNorm]) == MixedPrecision(
        _module_classes_to_ignore=(nn.LayerNorm,)
    )
    assert MixedPrecision(_module_classes_to_ignore={nn.BatchNorm2d})._module_classes_to_ignore == (nn.BatchNorm2d,)
    for bad in ["BatchNorm2d", nn.BatchNorm2d, nn.BatchNorm2d(3), [nn.BatchNorm2d(3)], (int,), ("BatchNorm2d",), 3]:
        with pytest.raises(TypeError, match="_module_classes_to_ignore"):
            MixedPrecision(torch.bfloat16, _module_classes_to_ignore=bad)


def _cnn_wrapped(policy: bool, net: nn.Module | None = None, **kw):
    """``net`` (default: a SmallCNN) under fullshard's wrapper (bfloat16 unless ``mixed_precision``
    says otherwise; a unit per ConvBlock with ``policy``), the warnings naming
    ``_module_classes_to_ignore``, and the number of units."""
    import warnings

    from fullshard import FSDP
    from fullshard.wrap import ModuleWrapPolicy, unit_count

    kw.setdefault("mixed_precision", torch.bfloat16)
    if policy:
        kw["auto_wrap_policy"] = ModuleWrapPolicy({ConvBlock})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FSDP(make_cnn() if net is None else net, **kw)
    warned = [str(w.message) for w in caught if "_module_classes_to_ignore" in str(w.message)]
    return model, warned, unit_count(model)


def _seen_dtypes(model: nn.Module, x: torch.Tensor) -> dict[str, tuple]:
    """Per BatchNorm module, (its input's, weight's, running mean's, output's dtype) in a training step."""
    seen: dict[str, tuple] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):  # registered after fullshard's casts: they ran
            name = ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module")
            m.register_forward_pre_hook(lambda m, a, n=name: seen.__setitem__(n, (a[0].dtype, m.weight.dtype)))
            m.register_forward_hook(
                lambda m, a, o, n=name: seen.__setitem__(n, (*seen[n], m.running_mean.dtype, o.dtype))
            )
    model(x).float().sum().backward()
    return seen


KEPT = (torch.float32, torch.float32, torch.float32, torch.bfloat16)  # computes in fp32, hands on bf16
LOW = (torch.bfloat16,) * 4


def full_precision_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP, MixedPrecision

    x = images(0, 4)[0]
    model, warned, units = _cnn_wrapped(True)
    assert units == 6 and len(warned) == 1 and "BatchNorm1d, BatchNorm2d" in warned[0], (units, warned)
    seen = _seen_dtypes(model, x)
    assert seen == {"blocks.0.bn": KEPT, "blocks.1.bn": KEPT, "norm": KEPT}, seen
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    # Without an auto_wrap_policy nothing is kept apart, as torch's: BatchNorm in bfloat16, no warning.
    model, warned, units = _cnn_wrapped(False)
    assert units == 1 and not warned and set(_seen_dtypes(model, x).values()) == {LOW}, (units, warned)
    # () applies mixed precision everywhere; a class list picks the classes kept.
    bf16 = (torch.bfloat16,) * 3
    model, warned, units = _cnn_wrapped(True, mixed_precision=MixedPrecision(*bf16, _module_classes_to_ignore=()))
    assert units == 3 and not warned and set(_seen_dtypes(model, x).values()) == {LOW}, (units, warned)
    only_1d = MixedPrecision(*bf16, _module_classes_to_ignore=(nn.BatchNorm1d,))
    model, warned, units = _cnn_wrapped(True, mixed_precision=only_1d)
    assert units == 4 and len(warned) == 1 and "class BatchNorm1d (" in warned[0], (units, warned)
    assert _seen_dtypes(model, x) == {"blocks.0.bn": LOW, "blocks.1.bn": LOW, "norm": KEPT}
    # An ignored BatchNorm stays out of every unit (its parameters and buffers float32, as given);
    # its casts are registered as torch's are.
    net = make_cnn()
    model, warned, units = _cnn_wrapped(True, net, ignored_modules=[net.norm])
    assert units == 5 and len(warned) == 1 and _seen_dtypes(model, x)["norm"] == KEPT, (units, warned)
    # A block wrapped before keeps its own settings: its BatchNorm is not split off.
    net = make_cnn()
    net.blocks[0] = FSDP(net.blocks[0], mixed_precision=torch.bfloat16)
    model, warned, units = _cnn_wrapped(True, net)
    assert units == 5 and "BatchNorm1d, BatchNorm2d" in warned[0], (units, warned)
    assert _seen_dtypes(model, x) == {"blocks.0.bn": LOW, "blocks.1.bn": KEPT, "norm": KEPT}
    return ["ok"]


@pytest.mark.timeout(120)
def test_batch_norm_kept_in_full_precision() -> None:
    assert run_ranks(full_precision_body, 2, timeout=100) == [["ok"], ["ok"]]
